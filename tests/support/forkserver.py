"""A fork server: imports once what a command needs, then forks one child per command, each running it
exactly as a fresh process would (its argv, environment and working directory), without paying the imports
per process.

- `python tests/support/forkserver.py` (mode relay): `python -m relay ...` (relay.cli.main), or with the argv
  `-m relay.trainers.job` a chunk's Ray job entrypoint, or `-m support.<module> ARGS` a test's own writer
  (its main(ARGS)), with torch, verl and the CPU trainer imported (~7 s per process otherwise). The fault tests
  kill many trainers: with a fork per trainer, 20 kill points and their resumes cost seconds, not minutes.
- `python tests/support/forkserver.py airflow`, started with an Airflow home's environment (Airflow reads its
  configuration when it is imported): `airflow ...` (airflow.__main__.main, what the `airflow` script runs),
  with Airflow's CLI and what Relay's tasks import (relay.airflow.preload.TASK_MODULES) imported: an
  `airflow dags test` runs every task of a DAG run in its own process, ~7 CPU-s of imports per run otherwise.

Protocol (JSON lines): stdin {"argv": [...], "env": {...}, "log": PATH[, "err": PATH][, "whole_env": true]
[, "cwd": DIR]} -> stdout {"pid": N};
stdin {"wait": N} -> stdout {"pid": N, "rc": CODE} (rc < 0: killed by signal -rc).
A child's stdout and stderr go to its log file. Run from the repo root.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins"))
MODE = sys.argv[1] if len(sys.argv) > 1 else "relay"
# The answers go out on the server's own copy of its stdout; whatever the imports print (Airflow logs to
# stdout) goes to stderr instead, never into the protocol.
ANSWERS = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

# Everything a command imports, imported before any fork (nothing here starts a thread or computes).
if MODE == "airflow":
    import airflow.__main__
    from airflow.cli import cli_parser
    from airflow.cli.commands import dag_command  # noqa: F401

    from relay.airflow.preload import TASK_MODULES

    for _name in TASK_MODULES:
        importlib.import_module(_name)
    cli_parser.get_parser()  # builds (and caches) the CLI's parser once

    def entry(argv: list[str]) -> int:
        sys.argv = ["airflow", *argv]
        airflow.__main__.main()
        return 0
else:
    import relay.cli
    import relay.trainers.tiny_grpo.trainer as tiny

    tiny._quiet_verl()
    import torch
    import torch.distributed.tensor  # noqa: F401
    from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: F401
    from transformers import Qwen2ForCausalLM  # noqa: F401
    from verl.trainer.ppo import core_algos  # noqa: F401
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager  # noqa: F401
    from verl.workers.config import ActorConfig  # noqa: F401

    import relay.checkpoints.resume
    import relay.checkpoints.safeload
    import relay.checkpoints.validate
    import relay.trainers.job

    def entry(argv: list[str]) -> int:
        if argv == ["-m", "relay.trainers.job"]:  # a chunk's Ray job entrypoint, its request in the environment
            return relay.trainers.job.main()
        if argv[:1] == ["-m"] and argv[1].startswith("support."):  # a test's own writer (support.old_dag_run)
            sys.path.append(str(ROOT / "tests"))  # last: tests/airflow must not hide Airflow
            return int(importlib.import_module(argv[1]).main(argv[2:]))
        return relay.cli.main(argv)


FAULT_ENV = "RELAY_FAULT_PAUSE_AT"


def child(
    argv: list[str], env: dict[str, str], log: str, err: str | None = None, whole_env: bool = False, cwd: str | None = None
) -> None:
    """In the forked child: stdout to the log file (stderr too, or to `err`), stdin from /dev/null, the
    request's environment (added to the server's, or with whole_env the child's whole environment, as
    subprocess's env= gives it) and working directory, then the command."""
    code = 1
    try:
        os.close(ANSWERS.fileno())  # the server's answers are not the child's to hold open
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
        if cwd:
            os.chdir(cwd)
        code = entry(argv)
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
            print(json.dumps({"pid": pid, "rc": rc}), file=ANSWERS, flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            child(req["argv"], req.get("env") or {}, req["log"], req.get("err"), bool(req.get("whole_env")), req.get("cwd"))
        print(json.dumps({"pid": pid}), file=ANSWERS, flush=True)


if __name__ == "__main__":
    main()
