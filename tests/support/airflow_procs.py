"""Airflow's four processes (api-server, scheduler, dag-processor, triggerer) for one test module, as
`relay stack up` starts them: on a database and a runs folder of the module's own, on a free port,
with the session's Ray head and S3 server."""

from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from pathlib import Path

from relay.devstack import stack
from relay.devstack.airflow_api import AirflowAPI
from support.polling import wait_for
from support.ports import free_port


@contextmanager
def airflow_processes(base: Path, runs: Path, db_url: str | None = None, broker_url: str | None = None, **env_extra: str):
    """Start them under base/ (home, pids, logs) reading the specs in `runs`; stop them at the end.
    db_url: None for SQLite in base/home (a copy of a migrated DB placed there first is migrated no further).
    broker_url: the CeleryExecutor with this broker (its workers are the caller's to start)."""
    saved = {k: os.environ.get(k) for k in ("RELAY_STACK_DIR", "RELAY_AIRFLOW_API_PORT")}
    # relay.devstack.stack reads both at each call: its pid files and the API's port stay this module's own
    os.environ.update(RELAY_STACK_DIR=str(base / "stack"), RELAY_AIRFLOW_API_PORT=str(free_port()))
    env = stack.airflow_env(base / "home", db_url, parallelism=4, broker_url=broker_url)
    # A module's specs are written before its Airflow starts and never change: the DAG processor parses them
    # once instead of every 30 s (each parse of the specs folder costs about 2 CPU-s on these 2 cores).
    env.update(RELAY_RUNS_DIR=str(runs), AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL="3600", **env_extra)
    try:
        stack.airflow_start(env)
        api = AirflowAPI(stack.airflow_url(), "admin", stack.airflow_password(base / "home"))
        yield {
            "api": api,
            "env": env,
            "home": base / "home",
            "url": stack.airflow_url(),
            "password": stack.airflow_password(base / "home"),
        }
    finally:
        stack.stop_processes([f"airflow-{comp}" for comp in stack.AIRFLOW_COMPONENTS])
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@contextmanager
def postgres_database(prefix: str):
    """A new, empty database on the machine's PostgreSQL (127.0.0.1:5432, trust auth), dropped at the end;
    yields its SQLAlchemy URL."""
    import psycopg2

    db = f"{prefix}_{uuid.uuid4().hex[:8]}"
    con = psycopg2.connect(dbname="postgres", host="127.0.0.1", port=5432, user="postgres")
    con.autocommit = True
    con.cursor().execute(f"CREATE DATABASE {db}")
    try:
        yield f"postgresql+psycopg2://postgres@127.0.0.1:5432/{db}"
    finally:
        con.cursor().execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        con.close()


def wait_until_parked(dag_id: str, run_id: str, task_id: str, timeout: float = 300) -> None:
    """Wait until the scheduler has handled the exit of the worker that parked the task in awaiting_input
    (its log: "TaskInstance Finished: ... state=awaiting_input"); only then may a test answer.
    Airflow 3.3.2's scheduler fails a task answered before that: the answer queues the task again, and the
    parking worker's late "success" then reads as a task changed from outside ("finished with state success,
    but the task instance's state attribute is queued"; scheduler_job_runner.py exempts only a task still
    SCHEDULED). Under CI's load it came 6 s after the park; a person answers minutes later."""
    log = stack.state_dir() / "logs" / "airflow-scheduler.log"
    key = f"TaskInstance Finished: dag_id={dag_id}, task_id={task_id}, run_id={run_id},"

    def handled() -> bool:
        return any(key in line and " state=awaiting_input," in line for line in log.read_text(errors="replace").splitlines())

    wait_for(handled, timeout, f"the scheduler to handle {task_id}'s park (in {log})")
