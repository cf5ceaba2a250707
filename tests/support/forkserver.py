"""A fork server for `relay train`: imports torch, verl and the CPU trainer once, then forks one child
per command, each running `python -m relay train ...` (relay.cli.main) exactly as a fresh process
would, but without paying ~7 s of imports per process. The fault tests kill many trainers: with a
fork per trainer, 20 kill points and their resumes cost seconds, not minutes.

Protocol (JSON lines): stdin {"argv": [...], "env": {...}, "log": PATH[, "err": PATH][, "whole_env": true]}
-> stdout {"pid": N};
stdin {"wait": N} -> stdout {"pid": N, "rc": CODE} (rc < 0: killed by signal -rc).
A child's stdout and stderr go to its log file. Run from the repo root: python tests/support/forkserver.py
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins"))

# Everything a trainer imports, imported before any fork (nothing here starts a thread or computes).
import relay.cli  # noqa: E402
import relay.trainers.tiny_grpo.trainer as tiny  # noqa: E402

tiny._quiet_verl()
import torch  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402,F401
from transformers import Qwen2ForCausalLM  # noqa: E402,F401
from verl.trainer.ppo import core_algos  # noqa: E402,F401
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager  # noqa: E402,F401
from verl.workers.config import ActorConfig  # noqa: E402,F401

import relay.checkpoints.resume  # noqa: E402,F401
import relay.checkpoints.safeload  # noqa: E402,F401
import relay.checkpoints.validate  # noqa: E402,F401

FAULT_ENV = "RELAY_FAULT_PAUSE_AT"


def child(argv: list[str], env: dict[str, str], log: str, err: str | None = None, whole_env: bool = False) -> None:
    """In the forked child: stdout to the log file (stderr too, or to `err`), stdin from /dev/null, the
    request's environment (added to the server's, or with whole_env the child's whole environment, as
    subprocess's env= gives it), then the CLI."""
    code = 1
    try:
        for path, fds in ((log, (1,) if err else (1, 2)), *(((err, (2,)),) if err else ())):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for target in fds:
                os.dup2(fd, target)
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the server's requests come on its stdin: never the child's
        os.close(null)
        if whole_env:
            os.environ.clear()
        os.environ.pop(FAULT_ENV, None)
        os.environ.update(env)
        code = relay.cli.main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - a crash trace goes to the log, the exit code says it failed
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    os.chdir(ROOT)
    for line in sys.stdin:
        req = json.loads(line)
        if "wait" in req:
            pid, status = os.waitpid(int(req["wait"]), 0)
            rc = os.waitstatus_to_exitcode(status)
            print(json.dumps({"pid": pid, "rc": rc}), flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            child(req["argv"], req.get("env") or {}, req["log"], req.get("err"), bool(req.get("whole_env")))
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    main()
