"""`relay train` of include/runs/verl_tiny_cpu.yaml as a user runs it, and what the verl tests watch of its
Ray job (tests/trainers/test_verl_cpu_fit.py, test_verl_reshard_resume.py; tests/airflow/test_verl_dag.py)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import yaml

from relay.runs import layout
from relay.runs.metrics import read_jsonl
from support.faults import alive, kill
from support.helpers import PY, ROOT, read_metrics

SPEC = ROOT / "include" / "runs" / "verl_tiny_cpu.yaml"
JOB_TIMEOUT = 900


def relay_train(run_dir: Path, to_step: int, ray_address: str, log: Path, spec: Path = SPEC) -> subprocess.Popen:
    """`relay train` of the verl spec into run_dir, as a user runs it, on the Ray head at ray_address."""
    return subprocess.Popen(
        [
            PY,
            "-m",
            "relay",
            "train",
            str(spec),
            "--to-step",
            str(to_step),
            "--checkpoint-dir",
            str(run_dir),
            "--offline",
            "--ray-address",
            ray_address,
        ],
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env={**os.environ},
    )


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


def two_chunks_with_a_kill(run_dir: Path, ray_address: str, logs: Path, settle_s: float) -> str:
    """Chunk 1 (0 -> 2) as one job; then chunk 2 (2 -> 4), its job's driver SIGKILLed after step 3's row and
    before the checkpoint of step 4. settle_s: the wait after the kill (verl's actors die with their driver)
    before checking that nothing committed step 4. Returns the killed `relay train`'s log."""
    finish(relay_train(run_dir, 2, ray_address, logs / "c1.log"), logs / "c1.log")
    first = {r["attempt"] for r in read_metrics(run_dir)}
    proc = relay_train(run_dir, 4, ray_address, logs / "c2.log")
    wait_for_step(run_dir, 3, first)
    pid = job_driver_pid(run_dir)
    assert pid is not None, "the chunk's Ray job driver was not found"
    assert not (run_dir / "global_step_4").exists()
    kill(pid)
    assert proc.wait(timeout=JOB_TIMEOUT) != 0, "relay train succeeded although its job was killed"
    assert not alive(pid)
    time.sleep(settle_s)
    assert layout.read_tracker(run_dir) == 2 and not (run_dir / "global_step_4").exists()
    return (logs / "c2.log").read_text(errors="replace")
