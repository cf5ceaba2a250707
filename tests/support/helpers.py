"""Helpers the tests share (specs, the CLI, metrics, bitwise comparison, Airflow's `dags test`).

Tests import them from here (`from support.helpers import ...`); tests/conftest.py holds only fixtures
and hooks, and imports what it needs from here too.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


PY = sys.executable


DEMO_SPEC = ROOT / "include" / "runs" / "demo.yaml"


DELETE = object()  # an override value that removes the key


def spec_dict(**overrides) -> dict:
    """The demo spec, shrunk for tests, with dotted-key overrides ("trainer.settings.rollout_n": 4)."""
    d = yaml.safe_load(DEMO_SPEC.read_text())
    d["total_steps"], d["chunk_steps"] = 12, 6
    d["chunks"] = {"handoff": "cold"}  # a new job per chunk, as most tests assert; a test of warm chunks says so
    d["threads"] = 1  # two test workers share two cores
    d["airflow"] = {"retries": 2, "retry_delay_seconds": 1}
    d["ray"]["poll_seconds"] = 0.5
    d["ray"]["stop_grace_seconds"] = 20  # a stopped tiny job saves in well under a second; Ray kills it after this
    # The Hugging Face export of the final step (verl's model merger: a process that imports verl, ~8 CPU-s) only
    # where a test looks at it (tests/airflow/test_run_dag.py).
    d["checkpoints"]["hf_export"] = False
    for key, value in overrides.items():
        node = d
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if value is DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = copy.deepcopy(value)
    return d


def write_spec(folder: Path, name: str = "t", **overrides) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    # Each spec publishes under its own S3 prefix, so runs of different tests never meet.
    d = spec_dict(
        name=name,
        **{"checkpoint_dir": str(folder / "ckpt"), "s3.uri": f"s3://relay/test-{uuid.uuid4().hex[:12]}", **overrides},
    )
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def relay_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m relay ...` as a user runs it from the repo root, with this environment plus `env`.

    The command runs in a child of this test process's fork server (tests/support/forkserver.py): the same
    `relay.cli.main(argv)` in a process of its own, its output captured alike, without paying the ~9 CPU-s of
    torch, transformers and verl imports per call. In a fresh interpreter: `relay stack` and `relay demo` (they
    start services that outlive the command), and any command run with verl settings in its environment."""
    full_env = {**os.environ, **(env or {})}
    # (verl reads VERL_* settings, its platform among them, when it is imported: the server imported it without)
    verl_env = any(k.startswith("VERL_") and k != "VERL_LOGGING_LEVEL" for k in full_env)
    if args[:1] not in (("stack",), ("demo",)) and not verl_env:
        return _forked_cli(list(args), full_env, timeout)
    return subprocess.run(
        [PY, "-m", "relay", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env
    )


_fork_server = None


def _forked_cli(argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`relay <argv>` in a fork server child (started once per test process), as subprocess.run would give it."""
    import atexit
    import tempfile

    from support.faults import ForkServer

    global _fork_server
    if _fork_server is None or _fork_server.proc.poll() is not None:
        _fork_server = ForkServer()
        atexit.register(_fork_server.close)
    with tempfile.TemporaryDirectory(prefix="relay-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = ForkedProcess(_fork_server, _fork_server.start(argv, out, env, err=err, whole_env=True))
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(
                ["relay", *argv], timeout, out.read_text(errors="replace"), err.read_text(errors="replace")
            ) from None
        return subprocess.CompletedProcess(
            ["relay", *argv], rc, out.read_text(errors="replace"), err.read_text(errors="replace")
        )


def train(spec, run_dir, to_step) -> subprocess.CompletedProcess:
    """`relay train` into run_dir, in a fresh process; asserts that it succeeded."""
    r = relay_cli("train", str(spec), "--to-step", str(to_step), "--checkpoint-dir", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def model_state(step_dir: Path) -> dict:
    """The actor's weights at a checkpoint, as plain tensors (through Relay's safe loader)."""
    from relay.checkpoints import safeload

    sd = safeload.load(step_dir / "actor" / "model_world_size_1_rank_0.pt", mmap=False)
    return {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in sd.items()}


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under folder, by relative path: what "untouched" means for a checkpoint."""
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def assert_bitwise_equal(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different[:5]}"


def dags_test(
    airflow_home: dict, dag_id: str, conf: dict, timeout: float = 900, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`airflow dags test DAG -c CONF`: real Airflow code, the trigger run in line; returns the process."""
    dag = BackgroundDagTest(airflow_home, dag_id, conf, env)
    try:
        rc, out = dag.wait(timeout)
    except subprocess.TimeoutExpired:
        dag.proc.kill()
        dag.proc.wait()
        raise
    return subprocess.CompletedProcess(dag.argv, rc, out, "")


def jobs_of_run(ray_address: str, run: str, since: float) -> list:
    """The Ray jobs (JobDetails) of run `run` submitted since `since` (epoch seconds): a Ray head left
    running keeps the jobs of earlier test sessions, whose runs had the same names."""
    from relay.jobs.ray_jobs import RayJobs

    return [
        j
        for j in RayJobs(ray_address).client.list_jobs()
        if (j.metadata or {}).get("relay_run") == run and (j.start_time or 0) / 1000 >= since - 1
    ]


class BackgroundDagTest:
    """`airflow dags test` in the background. Its output goes to a file: a pipe nobody reads while the
    test waits fills up and blocks Airflow's logging, which stalls the DAG run itself.

    It runs in a child of the Airflow home's fork server (`airflow_fork_server`): `airflow`'s own main with
    these arguments, environment and working directory in a process of its own, without ~7 CPU-s of imports
    per DAG run. In a fresh `airflow` process when `env` changes Airflow's or verl's settings (both are read
    at import)."""

    def __init__(self, airflow_home: dict, dag_id: str, conf: dict, env: dict | None = None):
        full_env = {**airflow_home["env"], **(env or {})}
        self.argv = ["dags", "test", dag_id, "-c", json.dumps(conf)]
        self.log = Path(airflow_home["home"]) / f"dags-test-{dag_id}-{uuid.uuid4().hex[:8]}.log"
        if any(
            k.startswith(("AIRFLOW__", "VERL_", "PYTHON")) and full_env[k] != airflow_home["env"].get(k) for k in env or {}
        ):
            with open(self.log, "w") as out:
                self.proc = subprocess.Popen(
                    [str(Path(PY).parent / "airflow"), *self.argv],
                    env=full_env,
                    cwd=full_env["AIRFLOW_HOME"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
        else:
            server = airflow_fork_server(airflow_home["env"])
            self.proc = ForkedProcess(
                server, server.start(self.argv, self.log, full_env, whole_env=True, cwd=Path(full_env["AIRFLOW_HOME"]))
            )

    def ended(self) -> str | None:
        """Its output once the DAG run has ended, else None: `gave_up` of a wait_for on something inside it."""
        if self.proc.poll() is None:
            return None
        return f"the DAG run ended:\n{self.log.read_text(errors='replace')[-5000:]}"

    def wait(self, timeout: float = 600) -> tuple[int, str]:
        """(return code, output) once the DAG run has ended."""
        rc = self.proc.wait(timeout=timeout)
        return rc, self.log.read_text(errors="replace")


class ForkedProcess:
    """A fork server's child, as much of subprocess.Popen as the tests use (poll, wait, kill, pid)."""

    def __init__(self, server, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        from support.faults import alive

        if self.returncode is None and not alive(self.pid):
            self.returncode = self.server.wait(self.pid)  # ended: the server reaps it at once
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(["airflow", "(forked)"], timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, 9)


_airflow_fork_servers: dict = {}


def airflow_fork_server(env: dict):
    """This test process's fork server for the Airflow home whose environment is `env` (started once)."""
    import atexit

    from support.faults import ForkServer

    key = json.dumps(env, sort_keys=True)
    server = _airflow_fork_servers.get(key)
    if server is None or server.proc.poll() is not None:
        server = _airflow_fork_servers[key] = ForkServer("airflow", env)
        atexit.register(server.close)
    return server


def start_dags_test(airflow_home: dict, dag_id: str, conf: dict, env: dict | None = None) -> BackgroundDagTest:
    return BackgroundDagTest(airflow_home, dag_id, conf, env)


@contextmanager
def session_shared(tmp_path_factory, name: str):
    """A folder shared by every xdist worker of this test session (one session's, never an earlier
    one's), held under a lock while in the `with`: what one worker builds there, the others reuse."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # /tmp/pytest-of-USER/pytest-N/popen-gwK -> the session's pytest-N
    folder = base / f"shared-{name}"
    folder.mkdir(exist_ok=True)
    with open(base / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


@contextmanager
def shared_service(tmp_path_factory, name: str, is_up, start, stop):
    """A service every xdist worker of this session uses (the S3 server, the Ray head): started once, by
    the first worker that finds it down, and stopped by the last worker to finish, only if this session
    started it. Yields what start() returns. (A worker that stopped it on finishing its own tests would pull it
    from under the others.)"""
    with session_shared(tmp_path_factory, f"service-{name}") as folder:
        users, ours = folder / "users", folder / "started-here"
        if not is_up():
            value = start()
            ours.touch()
        else:
            value = start()  # up already: start() only answers where it is
        users.write_text(str(int(users.read_text() or 0) + 1 if users.exists() else 1))
    try:
        yield value
    finally:
        with session_shared(tmp_path_factory, f"service-{name}") as folder:
            users, ours = folder / "users", folder / "started-here"
            left = int(users.read_text() or 1) - 1
            users.write_text(str(left))
            if left == 0 and ours.exists():
                ours.unlink()
                stop()
