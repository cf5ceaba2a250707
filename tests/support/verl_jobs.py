"""`relay train` of include/runs/verl_tiny_cpu.yaml as a user runs it, and what the verl tests watch of its
Ray job (tests/trainers/test_verl_cpu_fit.py, test_verl_cpu_chunks.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import yaml

from relay.runs import layout
from relay.runs.metrics import read_jsonl
from support.helpers import PY, ROOT

SPEC = ROOT / "include" / "runs" / "verl_tiny_cpu.yaml"
JOB_TIMEOUT = 900


def relay_train(run_dir: Path, to_step: int, ray_address: str, log: Path, spec: Path = SPEC) -> subprocess.Popen:
    """`relay train` of the verl spec into run_dir, as a user runs it, on the session's Ray head."""
    return subprocess.Popen([PY, "-m", "relay", "train", str(spec), "--to-step", str(to_step), "--checkpoint-dir",
                             str(run_dir), "--offline", "--ray-address", ray_address], cwd=ROOT,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ})


def with_job_env(path: Path, env: dict[str, str]) -> Path:
    """The verl spec with `env` in its chunk jobs' environment (ray.env_vars), written to `path`."""
    d = yaml.safe_load(SPEC.read_text())
    d.setdefault("ray", {}).setdefault("env_vars", {}).update(env)
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def finish(proc: subprocess.Popen, log: Path) -> str:
    rc = proc.wait(timeout=JOB_TIMEOUT)
    out = log.read_text(errors="replace")
    assert rc == 0, out[-6000:]
    return out


def job_driver_pid(run_dir: Path) -> int | None:
    """The Ray job's driver: the Python process (not the shell Ray starts it with) running
    `-m relay.trainers.job` whose chunk request names run_dir's checkpoint folder."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if not Path(argv[0].decode()).name.startswith("python") or b"relay.trainers.job" not in argv:
                continue
            if str(run_dir.parent).encode() in (proc / "environ").read_bytes():
                return int(proc.name)
        except (OSError, UnicodeDecodeError):
            continue
    return None


def wait_for_step(run_dir: Path, step: int, attempt_other_than: set, timeout: float = JOB_TIMEOUT) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for row in read_jsonl(run_dir / layout.METRICS):
            if row.get("step") == step and row.get("attempt") not in attempt_other_than:
                return row
        time.sleep(0.2)
    raise AssertionError(f"no metrics row of step {step} in {run_dir} within {timeout}s")
