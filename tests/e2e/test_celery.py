"""Relay on Airflow's CeleryExecutor, as a team that outgrows one machine runs it: the scheduler, api-server,
dag-processor and triggerer on PostgreSQL, a Redis broker (the machine's, a database number of this module's
own), and two Celery workers, each with its own working directory, Airflow home (its task logs) and temporary
folder, sharing only the checkpoint root with each other and the Ray jobs. A 3-chunk run succeeds; a worker
SIGKILLed while it validates chunk 2's checkpoint loses that try, and Airflow's retry runs it on the other."""

from __future__ import annotations

import os

import psutil
import pytest

from relay.devstack import stack
from relay.runs import layout
from relay.s3.store import store_for_spec
from relay.spec.run_spec import load_spec
from support.airflow_procs import airflow_processes, postgres_database
from support.helpers import read_metrics, write_spec
from support.polling import wait_for
from support.ports import free_port

# The faults lane's (./scripts/test.sh --faults): a third Airflow deployment, its own executor, beside CI's two.
pytestmark = pytest.mark.lane("faults")

REDIS_DB = 13  # this module's own database of the machine's Redis (127.0.0.1:6379)
WORKERS = ("relay-worker-a", "relay-worker-b")


def _flush_broker() -> None:
    import redis

    redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB).flushdb()


@pytest.fixture(scope="module")
def celery(tmp_path_factory, ray_address):
    base = tmp_path_factory.mktemp("celery")
    runs, faults = base / "runs", base / "faults"
    faults.mkdir()
    write_spec(runs, name="celery", total_steps=9, chunk_steps=3)
    _flush_broker()
    with (
        postgres_database("relay_celery") as db_url,
        airflow_processes(
            base,
            runs,
            db_url,
            broker_url=f"redis://127.0.0.1:6379/{REDIS_DB}",
            # a killed worker's task is found dead (no heartbeat) in seconds, not minutes
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="20",
        ) as af,
    ):
        # The first validate task of chunk 2 to start holds there, in whichever worker runs it, until it is killed.
        once = faults / "validate"
        env = {
            **af["env"],
            "RELAY_FAULT_PAUSE_AT": "validate:c@2",
            "RELAY_FAULT_ONCE": str(once),
            "RELAY_FAULT_PAUSE_S": "600",
        }
        pids = {name: stack.celery_worker_start(name, env, base / name, free_port()) for name in WORKERS}
        try:
            yield {**af, "runs": runs, "base": base, "once": once, "workers": pids}
        finally:
            stack.stop_processes(list(WORKERS), timeout=10)
            _flush_broker()


def _worker_of(pid: int, workers: dict[str, int]) -> str:
    """Which worker a task process runs under."""
    proc = psutil.Process(pid)
    for p in [proc, *proc.parents()]:
        for name, worker_pid in workers.items():
            if p.pid == worker_pid:
                return name
    raise AssertionError(f"process {pid} runs under neither worker ({workers})")


@pytest.mark.fault
def test_a_run_on_celery_workers_survives_a_worker_killed_during_a_validation(celery, fault_row):
    api, once = celery["api"], celery["once"]
    api.wait_for_dag("relay_celery")
    run_id = api.trigger("relay_celery", {"run": "c", "alert_channels": []})["dag_run_id"]
    wait_for(lambda: once.exists() and once.read_text().strip(), 900, "chunk 2's validate task to hold")
    task_pid = int(once.read_text())
    killed = _worker_of(task_pid, celery["workers"])
    assert stack.kill_process(killed)  # the worker's whole process group, its task with it
    if psutil.pid_exists(task_pid):
        os.kill(task_pid, 9)
    other = next(name for name in WORKERS if name != killed)

    run = api.wait_for_run("relay_celery", run_id, timeout=900)
    states = {t["task_id"]: (t["state"], t["try_number"]) for t in api.task_instances("relay_celery", run_id)}
    assert run["state"] == "success", sorted(states.items())
    assert states["chunk_02.validate"] == ("success", 2), "the killed try failed, its retry succeeded"
    logs = {
        name: [
            p
            for p in (celery["base"] / name / "airflow-home" / "logs").rglob("*.log")
            if "task_id=chunk_02.validate" in str(p)
        ]
        for name in WORKERS
    }
    assert [p.name for p in logs[other]] == ["attempt=2.log"], logs
    assert [p.name for p in logs[killed]] == ["attempt=1.log"], logs

    spec = load_spec(celery["runs"] / "celery.yaml", check_environment=False)
    run_dir = spec.run_dir("c")
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 10)), "each step once"
    assert layout.read_tracker(run_dir) == 9
    assert [m.step for m in store_for_spec(spec).published("c")] == [3, 6, 9]
    fault_row(
        case="celery-worker-kill",
        layer="Airflow's CeleryExecutor (two workers, Redis broker), Ray, S3",
        fault="a Celery worker is SIGKILLed while it validates chunk 2's checkpoint",
        action="the scheduler found the try dead (no heartbeat) and Airflow retried it; the other worker "
        "validated step 6 and the run went on to step 9; nothing was trained again",
        steps_lost=0,
        run_dir=run_dir,
        store=store_for_spec(spec),
    )
