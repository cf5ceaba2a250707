"""Shared fixtures: one Ray head for the whole session (started here unless .ci/run already started
it), an Airflow home on SQLite for `airflow dags test`, and small run specs written per test."""

from __future__ import annotations

import copy
import fcntl
import json
import os
import shutil
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from support.faults import fault_row  # noqa: F401 (a fixture: a fault case's row of docs/FAULTS.md)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
DEMO_SPEC = ROOT / "include" / "runs" / "demo.yaml"


# The slowest files first: xdist hands out files in collection order, so a long file collected last
# would run alone at the end while the other worker idles (longest-first scheduling).
SLOW_FIRST = ("e2e/test_real_airflow.py", "e2e/test_ui.py", "airflow/test_run_dag.py", "faults/test_ray_head_orphan.py",
              "faults/test_ray_head_restart.py", "airflow/test_data_dag.py", "airflow/test_alerts_dag.py",
              "faults/test_kill_points.py", "faults/test_s3_outage.py", "faults/test_disk_full.py",
              "trainers/test_verl_chunk.py", "faults/test_corruption_stack.py", "core/test_validate.py",
              "faults/test_s3_faults.py", "faults/test_corruption.py", "faults/test_data_change.py",
              "core/test_report.py")


# The fast lane (`scripts/test.sh --fast`, RELAY_FAST_LANE=1): only tests that need no service run, and
# nothing is started. A test needs a service when it uses one of these fixtures, is marked `services`
# (it reaches S3, Ray or Airflow by itself: `relay train` looks at S3 unless --offline), or lives where
# every test does (tests/airflow, tests/e2e, tests/faults).
FAST_LANE = os.environ.get("RELAY_FAST_LANE") == "1"
SERVICE_FIXTURES = {"ray_address", "airflow_home", "uninterrupted_run", "uninterrupted", "baseline", "interrupted",
                    "store", "s3", "airflow"}
SERVICE_FOLDERS = ("/tests/airflow/", "/tests/e2e/", "/tests/faults/")


def needs_services(item) -> bool:
    import inspect

    path = item.path.as_posix()
    asked = set(inspect.signature(item.obj).parameters)  # s3_server is every test's (autouse): asked for by name
    return (any(folder in path for folder in SERVICE_FOLDERS) or bool(SERVICE_FIXTURES & set(item.fixturenames))
            or "s3_server" in asked or item.get_closest_marker("services") is not None)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.path.as_posix()
        return next((i for i, name in enumerate(SLOW_FIRST) if path.endswith(name)), len(SLOW_FIRST))

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept
    for item in items:  # the fault suite (`-m fault`): tests/faults/, and the cases marked elsewhere
        if "/tests/faults/" in item.path.as_posix():
            item.add_marker(pytest.mark.fault)
    if FAST_LANE:
        slow = [item for item in items if needs_services(item)]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not needs_services(item)]


DELETE = object()  # an override value that removes the key


def spec_dict(**overrides) -> dict:
    """The demo spec, shrunk for tests, with dotted-key overrides ("trainer.settings.rollout_n": 4)."""
    d = yaml.safe_load(DEMO_SPEC.read_text())
    d["total_steps"], d["chunk_steps"] = 12, 6
    d["threads"] = 1  # two test workers share two cores
    d["airflow"] = {"retries": 2, "retry_delay_seconds": 1}
    d["ray"]["poll_seconds"] = 0.5
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
    d = spec_dict(name=name, **{"checkpoint_dir": str(folder / "ckpt"),
                                "s3.uri": f"s3://relay/test-{uuid.uuid4().hex[:12]}", **overrides})
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def relay_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m relay ...` in a fresh process, as a user runs it from the repo root."""
    return subprocess.run([PY, "-m", "relay", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def train(spec, run_dir, to_step) -> subprocess.CompletedProcess:
    """`relay train` into run_dir, in a fresh process; asserts that it succeeded."""
    r = relay_cli("train", str(spec), "--to-step", str(to_step), "--checkpoint-dir", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, uninterrupted_run):
    """A test spec of the module's own (its own S3 prefix), and the uninterrupted run of that spec's
    settings, 0 -> 12 in one process (shared, read only)."""
    return write_spec(tmp_path_factory.mktemp("baseline")), uninterrupted_run


@pytest.fixture(scope="session", autouse=True)
def s3_server():
    """The session's S3 server (SeaweedFS, bucket `relay`); boto3 in tests and their subprocesses uses it.
    Not in the fast lane, whose tests need no service."""
    if FAST_LANE:
        yield None
        return
    from relay.devstack import stack

    already = stack._http_ok(stack.s3_endpoint())
    endpoint = stack.s3_start()
    saved = {k: os.environ.get(k) for k in stack.s3_env()}
    os.environ.update(stack.s3_env())
    yield endpoint
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if not already:
        stack.stop_process("s3", timeout=2)


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

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different[:5]}"


@pytest.fixture(scope="session")
def ray_address():
    """The session's Ray head (started outside the repo, from the stack's state folder)."""
    from relay.devstack import stack

    already = stack._http_ok(f"{stack.ray_address()}/api/version")
    address = stack.ray_start()
    yield address
    if not already:
        stack.ray_stop()


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory, ray_address):
    """An Airflow home on SQLite (migrated once) whose DAG factory reads the session's specs folder."""
    from relay.devstack import stack

    home = tmp_path_factory.mktemp("airflow_home")
    runs = tmp_path_factory.mktemp("runs")
    env = stack.airflow_env(home)
    env.update({"RELAY_RUNS_DIR": str(runs), "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False"})
    with session_shared(tmp_path_factory, "airflow-db") as shared:  # one migration for all workers
        if not (shared / "airflow.db").exists():
            stack.airflow_cli({**env, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{shared / 'airflow.db'}"},
                              "db", "migrate")
    shutil.copyfile(shared / "airflow.db", home / "airflow.db")
    return {"env": env, "home": home, "runs": runs}


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


@pytest.fixture(scope="session")
def uninterrupted_run(tmp_path_factory) -> Path:
    """The test spec's run trained 0 -> 12 in one plain `relay train` process (read only): the baseline
    every bitwise test compares with. Built once per session for all workers. Chunking, resumes and
    save_freq do not change a bit of it: that is what those tests assert."""
    with session_shared(tmp_path_factory, "uninterrupted") as shared:
        run_dir = shared / "ckpt" / "straight"
        if not (run_dir / "global_step_12").exists():
            train(write_spec(shared), run_dir, 12)
    return run_dir


@pytest.fixture(scope="session")
def uninterrupted(uninterrupted_run) -> dict:
    """Its final weights."""
    return model_state(uninterrupted_run / "global_step_12")


def dags_test(airflow_home: dict, dag_id: str, conf: dict, timeout: float = 900,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """`airflow dags test DAG -c CONF`: real Airflow code, the trigger run in line; returns the process."""
    env = {**airflow_home["env"], **(env or {})}
    return subprocess.run([str(Path(PY).parent / "airflow"), "dags", "test", dag_id, "-c", json.dumps(conf)],
                          env=env, cwd=env["AIRFLOW_HOME"], capture_output=True, text=True, timeout=timeout)


def jobs_of_run(ray_address: str, run: str, since: float) -> list:
    """The Ray jobs (JobDetails) of run `run` submitted since `since` (epoch seconds): a Ray head left
    running keeps the jobs of earlier test sessions, whose runs had the same names."""
    from relay.jobs.ray_jobs import RayJobs

    return [j for j in RayJobs(ray_address).client.list_jobs()
            if (j.metadata or {}).get("relay_run") == run and (j.start_time or 0) / 1000 >= since - 1]


class BackgroundDagTest:
    """`airflow dags test` in the background. Its output goes to a file: a pipe nobody reads while the
    test waits fills up and blocks Airflow's logging, which stalls the DAG run itself."""

    def __init__(self, airflow_home: dict, dag_id: str, conf: dict, env: dict | None = None):
        env = {**airflow_home["env"], **(env or {})}
        self.log = Path(airflow_home["home"]) / f"dags-test-{dag_id}-{uuid.uuid4().hex[:8]}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([str(Path(PY).parent / "airflow"), "dags", "test", dag_id, "-c",
                                          json.dumps(conf)], env=env, cwd=env["AIRFLOW_HOME"], stdout=out,
                                         stderr=subprocess.STDOUT, text=True)

    def wait(self, timeout: float = 600) -> tuple[int, str]:
        """(return code, output) once the DAG run has ended."""
        rc = self.proc.wait(timeout=timeout)
        return rc, self.log.read_text(errors="replace")


def start_dags_test(airflow_home: dict, dag_id: str, conf: dict, env: dict | None = None) -> BackgroundDagTest:
    return BackgroundDagTest(airflow_home, dag_id, conf, env)


@pytest.fixture(scope="module")
def receivers():
    """A real SMTP server and HTTP receiver on 127.0.0.1, and the Airflow connections that name them."""
    from support.receivers import HttpSink, MailSink, connections

    mail, http = MailSink(), HttpSink()
    yield {"mail": mail, "http": http, "env": connections(mail, http)}
    mail.stop()
    http.stop()


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Run "r": its data frozen and its settings recorded at the first chunk, trained to step 6 of 12
    (checkpoints at 3 and 6) and stopped there, as a run between two chunks is."""
    import shutil

    from relay.preflight.checks import prepare_data
    from relay.preflight.prepare import prepare_run
    from relay.runs.spec import load_spec

    base = tmp_path_factory.mktemp("interrupted")
    source = Path(shutil.copy(ROOT / "include" / "data" / "arith_train.parquet", base / "source.parquet"))
    overrides = {"checkpoint_dir": str(base / "ckpt"), "s3.uri": f"s3://relay/test-{uuid.uuid4().hex[:12]}",
                 "data.train_files": [str(source)], "data.val_files": [], "trainer.settings.save_freq": 3}
    spec_path = write_spec(base, **overrides)
    spec = load_spec(spec_path)
    prepare_run(spec, "r")
    prepare_data(spec, "r")
    trained = relay_cli("train", str(spec_path), "--to-step", "6", "--run", "r", "--offline")
    assert trained.returncode == 0, trained.stderr[-3000:]
    return {"base": base, "spec_path": spec_path, "spec": spec, "run_dir": spec.run_dir("r"), "source": source,
            "overrides": overrides}
