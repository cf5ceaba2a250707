"""`relay train` of include/runs/verl_tiny_cpu.yaml as a user runs it, and what the verl tests watch of its
Ray job (tests/trainers/test_verl_cpu_fit.py, test_verl_reshard_resume.py; tests/airflow/test_verl_dag.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import yaml

from relay.common.faultpoint import FAULT_ENV
from relay.runs import layout
from relay.runs.metrics import read_jsonl
from relay.trainers import stopping
from support.faults import alive, kill
from support.helpers import PY, ROOT, read_metrics, start_dags_test

SPEC = ROOT / "include" / "runs" / "verl_tiny_cpu.yaml"
ASYNC_SPEC = ROOT / "include" / "runs" / "verl_tiny_cpu_async.yaml"  # verl's colocate_async trainer
SEPARATE_SPEC = ROOT / "include" / "runs" / "verl_tiny_cpu_separate.yaml"  # verl's separate_async trainer
LOSSLESS_SPEC = ROOT / "include" / "runs" / "verl_tiny_cpu_lossless.yaml"  # separate_async at its own speed, lossless
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


def with_job_env(path: Path, env: dict[str, str], spec: Path = SPEC) -> Path:
    """The verl spec with `env` in its chunk jobs' environment (ray.env_vars), written to `path`."""
    d = yaml.safe_load(spec.read_text())
    d.setdefault("ray", {}).setdefault("env_vars", {}).update(env)
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def spec_variant(path: Path, checkpoint_dir: Path, settings: dict, checkpoints: dict | None = None) -> Path:
    """The verl CPU spec with `settings` (trainer.settings) and `checkpoints` changed, its runs under checkpoint_dir
    and its data files absolute, written to `path`."""
    d = yaml.safe_load(SPEC.read_text())
    d["trainer"]["settings"].update(settings)
    d["checkpoints"].update(checkpoints or {})
    d["checkpoint_dir"] = str(checkpoint_dir)
    d["data"]["train_files"] = [str(ROOT / f) for f in d["data"]["train_files"]]
    d["data"]["val_files"] = [str(ROOT / f) for f in d["data"]["val_files"]]
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
    return killed_after_step_3(run_dir, ray_address, logs / "c2.log", settle_s)


def killed_after_step_3(run_dir: Path, ray_address: str, log: Path, settle_s: float, spec: Path = SPEC) -> str:
    """`relay train` to step 4, its job's driver SIGKILLed after step 3's row and before the checkpoint of step 4;
    the tracker must stay at step 2. Returns the killed `relay train`'s log."""
    earlier = {r["attempt"] for r in read_metrics(run_dir)} if (run_dir / layout.METRICS).exists() else set()
    proc = relay_train(run_dir, 4, ray_address, log, spec)
    wait_for_step(run_dir, 3, earlier)
    pid = job_driver_pid(run_dir)
    assert pid is not None, "the chunk's Ray job driver was not found"
    assert not (run_dir / "global_step_4").exists()
    kill(pid)
    assert proc.wait(timeout=JOB_TIMEOUT) != 0, "relay train succeeded although its job was killed"
    assert not alive(pid)
    time.sleep(settle_s)
    assert layout.read_tracker(run_dir) == 2 and not (run_dir / "global_step_4").exists()
    return log.read_text(errors="replace")


def optimizer_state(step_dir) -> dict:
    """The actor's optimizer state at a checkpoint, flattened to {path: tensor or value} (Relay's safe loader)."""
    from relay.checkpoints import safeload

    flat: dict = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}/{i}", x)
        else:
            flat[prefix] = v.to_local() if hasattr(v, "to_local") else v

    walk("", safeload.load(step_dir / "actor" / "optim_world_size_1_rank_0.pt", mmap=False))
    return flat


def dag_spec(source: Path, folder: Path, ray_conn_id: str, **changes) -> Path:
    """A shipped verl spec for a DAG test: this module's checkpoint folder, an S3 prefix of its own, its Ray connection,
    approvals off (`airflow dags test` has no API server to answer a question with), and `changes` on top (`settings`:
    keys of trainer.settings)."""
    d = yaml.safe_load(source.read_text())
    d["checkpoint_dir"] = str(folder / "ckpt")
    d["data"]["train_files"] = [str(ROOT / f) for f in d["data"]["train_files"]]
    d["data"]["val_files"] = [str(ROOT / f) for f in d["data"]["val_files"]]
    d.setdefault("s3", {})["uri"] = f"s3://relay/test-{d['name'].replace('_', '-')}-{int(time.time())}"
    d["ray"]["conn_id"] = ray_conn_id
    d["airflow"]["approvals"] = False
    settings = changes.pop("settings", {})
    d["trainer"]["settings"].update(settings)
    d.update(changes)
    path = folder / source.name
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def dag_with_chunk_2_killed(airflow_home: dict, dag_id: str, run: str, run_dir: Path, env: dict) -> tuple[int, str]:
    """`airflow dags test` of a verl spec's DAG whose chunk 2 job (chunk 1's, gone on warm into chunk 2) is SIGKILLed
    after step 3's row, before step 4's checkpoint. Returns the DAG test's return code and output."""
    dag = start_dags_test(airflow_home, dag_id, {"run": run}, env=env)
    try:
        wait_for_step(run_dir, 3, set())
        pid = job_driver_pid(run_dir)
        assert pid is not None, "chunk 2's Ray job driver was not found"
        assert not (run_dir / "global_step_4").exists(), "the kill came too late: step 4 is saved"
        kill(pid)
        deadline = time.time() + 30  # SIGKILL is delivered, and a 700 MB driver torn down, when the kernel gets
        while alive(pid) and time.time() < deadline:  # to it: not at once on two loaded cores
            time.sleep(0.05)
        assert not alive(pid), f"chunk 2's job driver {pid} outlived its SIGKILL by 30 s"
        return dag.wait(timeout=3 * JOB_TIMEOUT)
    finally:
        if dag.proc.poll() is None:
            dag.proc.kill()


def stopped_gracefully(run_dir: Path, after: int, to_step: int, ray_address: str, logs: Path, spec: Path = SPEC) -> int:
    """`relay train` to_step, SIGTERMed once its actor is held at the end of step `after`: the driver passes the stop
    on to verl's actor, which saves that step through verl's own save path and ends. Returns its exit code."""
    held = logs / f"held-at-step-{after}"
    held_spec = with_job_env(
        logs / f"held-{spec.name}", {FAULT_ENV: f"verl_step_end@{after}", "RELAY_FAULT_ONCE": str(held)}, spec
    )
    log = logs / f"stopped-at-{after}.log"
    proc = relay_train(run_dir, to_step, ray_address, log, held_spec)
    try:
        deadline = time.time() + JOB_TIMEOUT
        while not held.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert held.exists(), log.read_text(errors="replace")[-6000:]
        proc.send_signal(signal.SIGTERM)
        requests = layout.relay_dir(run_dir, stopping.STOP_DIR)  # the driver's request to its actor
        while not (requests.is_dir() and any(requests.iterdir())) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
    finally:
        Path(f"{held}.go").touch()
    return proc.wait(timeout=JOB_TIMEOUT)


def full_model(step_dir, world_size: int) -> dict:
    """A verl checkpoint's model parameters, its ranks' FSDP2 pieces put together (dim 0)."""
    import torch

    from relay.checkpoints.safeload import load

    sds = [load(step_dir / "actor" / layout.shard_name("model", world_size, r)) for r in range(world_size)]
    return {k: torch.cat([sd[k].to_local() if hasattr(sd[k], "to_local") else sd[k] for sd in sds], 0) for k in sds[0]}


def swap_rank_shards(run_dir, step: int) -> list[str]:
    """Rank 0's and rank 1's pieces of every parameter whose pieces have one shape swapped, each shard re-saved by
    torch (its zip CRCs hold); the manifest made again by the gate, as for a checkpoint validated after the
    change. Returns the parameters swapped."""
    import torch

    from relay.checkpoints import manifest
    from relay.checkpoints.gate import admit_dir

    actor = layout.step_dir(run_dir, step) / "actor"
    paths = [actor / layout.shard_name("model", 2, r) for r in (0, 1)]
    a, b = (torch.load(p, weights_only=False) for p in paths)
    swapped = []
    for k in a:
        la = a[k].to_local() if hasattr(a[k], "to_local") else a[k]
        lb = b[k].to_local() if hasattr(b[k], "to_local") else b[k]
        if la.shape == lb.shape and not torch.equal(la, lb):
            held = la.clone()
            la.copy_(lb)
            lb.copy_(held)
            swapped.append(k)
    torch.save(a, paths[0])
    torch.save(b, paths[1])
    (layout.step_dir(run_dir, step) / manifest.NAME).unlink(missing_ok=True)
    assert admit_dir(run_dir, step).ok, "shapes, values and checksums hold: the gate admits it"
    return swapped
