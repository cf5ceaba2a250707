"""Shared fixtures: one Ray head for the whole session (started here unless .ci/run already started
it), an Airflow home on SQLite for `airflow dags test`, and small run specs written per test."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from relay.runs.run import Run
from support.faults import fault_row  # noqa: F401 (a fixture: a fault case's row of docs/FAULTS.md)
from support.helpers import ROOT, model_state, relay_cli, session_shared, shared_service, train, write_spec

# The slowest files first (longest-processing-time-first: a long file handed out last would run alone at the end
# while the other workers idle), by their times in a full run (.relay/test-results/junit.xml); verl's DAG
# first of all, its jobs busy the cores while the Airflow files wait on their schedulers. scripts/test.sh passes
# --no-loadscope-reorder: xdist's default hands out the files with the most tests first, and this order would
# then only break its ties (verl's 4-test file would start late and end long after the others).
SLOW_FIRST = (
    "trainers/test_verl_cpu_fit.py",
    "airflow/test_verl_dag.py",
    "airflow/test_verl_separate_dag.py",
    "airflow/test_verl_async_dag.py",
    "e2e/test_retries.py",
    "airflow/test_run_dag.py",
    "e2e/test_real_airflow.py",
    "e2e/test_celery.py",
    "e2e/test_ui.py",
    "airflow/test_alerts_dag.py",
    "airflow/test_data_dag.py",
    "s3/test_store.py",
    "faults/test_ray_head_orphan.py",
    "trainers/test_verl_cpu_platform.py",
    "checkpoints/test_validate.py",
    "faults/test_kill_points.py",
    "faults/test_disk_full.py",
    "checkpoints/test_reshard.py",
    "faults/test_data_change.py",
    "trainers/test_verl_chunk.py",
    "faults/test_ray_head_restart.py",
    "faults/test_corruption.py",
    "faults/test_s3_faults.py",
    "trainers/test_tiny_grpo.py",
    "trainers/test_certified_resume.py",
    "faults/test_s3_outage.py",
    "faults/test_corruption_stack.py",
    "jobs/test_local_head.py",
    "trainers/test_graceful_stop.py",
    "insights/test_report.py",
    "airflow/test_dag_parse.py",
)


# A test that needs a service (the S3 server, Ray or Airflow) is marked `services`: every test under tests/e2e
# and tests/faults (SERVICE_FOLDERS), and elsewhere by its own mark (a module's pytestmark, or a test's). The
# session's S3 server starts for the first such test only, and a test that asks for a service's fixture without
# the mark is an error at collection, so `-m "not services"` (`scripts/test.sh --local`) runs every other test
# with nothing started.
# The lanes (docs/development.md): a test marked `lane("verl")` or `lane("faults")` is a proof too heavy for CI's two
# cores beside the rest of the suite (verl's trainer end to end, a second Airflow deployment, a private Ray cluster).
# CI leaves it out; its lane runs it before every landing (`./scripts/test.sh --lanes`), RELAY_TEST_LANE naming
# the lane: `verl` runs the tests marked lane("verl") only; `faults` runs the whole fault matrix, every case marked
# `fault` whether CI runs it or not, and the whole kill matrix (tests/faults/test_kill_points.py).
LANES = ("verl", "faults")
LANE = os.environ.get("RELAY_TEST_LANE") or None
SERVICE_FIXTURES = {
    "s3_server",
    "ray_address",
    "airflow_home",
    "uninterrupted_run",
    "uninterrupted",
    "baseline",
    "interrupted",
    "store",
    "s3",
    "airflow",
}
SERVICE_FOLDERS = ("/tests/e2e/", "/tests/faults/")  # system tests: every one of them
# A test that runs a trainer, verl's engine, torch.distributed ranks or a fresh interpreter is marked `processes`
# (no service, but seconds to a minute of CPU each): by its module's pytestmark, its own mark, or a fixture below
# that does so for it. The fast lane (`scripts/test.sh --fast`) leaves them out: it is the unit tests, in under two
# minutes; `scripts/test.sh --local` runs them too, and the full suite runs everything.
PROCESS_FIXTURES = {
    "verl_checkpoints",  # verl's checkpoints written by torch.distributed ranks (tests/checkpoints/test_validate.py)
    "resumed",  # a CPU run killed and resumed (tests/insights/test_replay_audit.py)
    "killed",  # the same, for the goodput ledger (tests/insights/test_goodput.py)
    "small_run",  # a short CPU run (tests/s3/test_store.py)
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks added here
def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.path.as_posix()
        return next((i for i, name in enumerate(SLOW_FIRST) if path.endswith(name)), len(SLOW_FIRST))

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept
    unmarked = []
    for item in items:
        path = item.path.as_posix()
        if "/tests/faults/" in path:  # the fault suite (`-m fault`): tests/faults/, and the cases marked elsewhere
            item.add_marker(pytest.mark.fault)
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)
        if any(folder in path for folder in SERVICE_FOLDERS):
            item.add_marker(pytest.mark.services)
        elif SERVICE_FIXTURES & set(item.fixturenames) and item.get_closest_marker("services") is None:
            unmarked.append(f"{item.nodeid} (uses {', '.join(sorted(SERVICE_FIXTURES & set(item.fixturenames)))})")
    for item in items:
        # The session's S3 server before any other fixture of a marked test: a module's fixture that starts
        # Airflow or a trainer reads S3's address from the environment the server's fixture sets.
        names = getattr(item, "fixturenames", None)
        if item.get_closest_marker("services") is not None and names is not None and "s3_server" not in names[:1]:
            if "s3_server" in names:
                names.remove("s3_server")
            names.insert(0, "s3_server")
    if unmarked:
        raise pytest.UsageError(
            "these tests use a service without the `services` mark; add @pytest.mark.services "
            "(the fast lane would start the service for them):\n  " + "\n  ".join(unmarked)
        )
    keep, left_out, bad = [], [], []
    for item in items:
        mark = item.get_closest_marker("lane")
        lane = mark.args[0] if mark and mark.args else None
        if mark is not None and lane not in LANES:
            bad.append(f"{item.nodeid} (lane {lane!r}; the lanes are {', '.join(LANES)})")
        elif lane == "faults" and item.get_closest_marker("fault") is None:
            bad.append(f"{item.nodeid} (the faults lane holds fault cases only: mark it `fault`)")
        if LANE is None:
            wanted = lane is None  # CI: every test that is in no lane
        elif LANE == "faults":
            wanted = item.get_closest_marker("fault") is not None
        else:
            wanted = lane == LANE
        (keep if wanted else left_out).append(item)
    if LANE is not None and LANE not in LANES:
        bad.append(f"RELAY_TEST_LANE={LANE}: no such lane; the lanes are {', '.join(LANES)}")
    if bad:
        raise pytest.UsageError("lane marks that cannot be run:\n  " + "\n  ".join(bad))
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = keep


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, uninterrupted_run):
    """A test spec of the module's own (its own S3 prefix), and the uninterrupted run of that spec's
    settings, 0 -> 12 in one process (shared, read only)."""
    return write_spec(tmp_path_factory.mktemp("baseline")), uninterrupted_run


@pytest.fixture(scope="session", autouse=True)
def data_check_cache(tmp_path_factory):
    """Remembered data-quality passes (relay.data.quality) in a folder of this session's, shared by its workers and
    the Airflow processes and jobs they start: never another pytest session's, nor the user's ~/.cache."""
    with session_shared(tmp_path_factory, "data-checks") as folder:
        pass
    saved = os.environ.get("RELAY_DATA_CHECK_CACHE")
    os.environ["RELAY_DATA_CHECK_CACHE"] = str(folder)
    yield folder
    if saved is None:
        os.environ.pop("RELAY_DATA_CHECK_CACHE", None)
    else:
        os.environ["RELAY_DATA_CHECK_CACHE"] = saved


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The session's S3 server (SeaweedFS, bucket `relay`); boto3 in tests and their subprocesses uses it.
    Started unless one answers (scripts/test.sh starts it first), shared by the session's workers."""
    from relay.devstack import stack

    with shared_service(
        tmp_path_factory,
        "s3",
        lambda: stack._http_ok(stack.s3_endpoint()),
        stack.s3_start,
        lambda: stack.stop_process("s3", timeout=2),
    ) as endpoint:
        saved = {k: os.environ.get(k) for k in stack.s3_env()}
        os.environ.update(stack.s3_env())
        yield endpoint
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def ray_address(tmp_path_factory):
    """The session's Ray head (started outside the repo, from the stack's state folder), shared by the session's
    workers."""
    from relay.devstack import stack

    # 2 logical CPUs, as many chunk jobs at once as the 2 cores take; verl's lane needs the stack's default
    # (stack.MIN_HEAD_CPUS: a verl chunk holds 4 and needs one more free).
    with shared_service(
        tmp_path_factory,
        "ray",
        lambda: stack._http_ok(f"{stack.ray_address()}/api/version"),
        lambda: stack.ray_start(num_cpus=None if LANE == "verl" else 2),
        stack.ray_stop,
    ) as address:
        yield address


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
            stack.airflow_cli(
                {**env, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{shared / 'airflow.db'}"}, "db", "migrate"
            )
    shutil.copyfile(shared / "airflow.db", home / "airflow.db")
    return {"env": env, "home": home, "runs": runs}


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
    from relay.spec.run_spec import load_spec

    base = tmp_path_factory.mktemp("interrupted")
    source = Path(shutil.copy(ROOT / "include" / "data" / "arith_train.parquet", base / "source.parquet"))
    overrides = {
        "checkpoint_dir": str(base / "ckpt"),
        "s3.uri": f"s3://relay/test-{uuid.uuid4().hex[:12]}",
        "data.train_files": [str(source)],
        "data.val_files": [],
        "trainer.settings.save_freq": 3,
    }
    spec_path = write_spec(base, **overrides)
    spec = load_spec(spec_path)
    prepare_run(spec, "r")
    prepare_data(Run.of(spec, "r"))
    trained = relay_cli("train", str(spec_path), "--to-step", "6", "--run", "r", "--offline")
    assert trained.returncode == 0, trained.stderr[-3000:]
    return {
        "base": base,
        "spec_path": spec_path,
        "spec": spec,
        "run_dir": spec.run_dir("r"),
        "source": source,
        "overrides": overrides,
    }
