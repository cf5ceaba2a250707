"""Retries and concurrency on the real scheduler: Airflow's four processes (LocalExecutor) on a PostgreSQL
database of this module's own, with the session's Ray head and S3 server, and a webhook that records
every alert.

- A train task that fails for a reason of Airflow's own while its job trains well (a person clears it,
  the worker running it is SIGKILLed between submission and deferral): the next try adopts the job,
  and not one step is trained twice.
- A frozen job (SIGSTOP) is still found out, stopped and resumed.
- Every failure a person must act on alerts once; "recovered" only once the failed work succeeded.
- Chunk k's publish overlaps chunk k+1's training; two runs in a one-slot pool never train at once.

Each scenario's run trains 12 steps in chunks of 6 with the tiny trainer (the pool's two runs, 6 in one chunk).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import pytest

from relay.runs import layout
from relay.runs.metrics import read_events, read_jsonl
from relay.s3.store import store_for_spec
from relay.spec.run_spec import load_spec
from support.airflow_procs import airflow_processes, postgres_database
from support.helpers import assert_bitwise_equal, jobs_of_run, model_state, read_metrics, write_spec
from support.polling import wait_for


@pytest.fixture(scope="module")
def airflow(tmp_path_factory, ray_address, receivers):
    """Airflow on a fresh PostgreSQL database, reading this module's specs (12 steps in chunks of 6)."""
    base = tmp_path_factory.mktemp("retries")
    runs, faults = base / "runs", base / "faults"
    faults.mkdir()

    def paused_at_step_3(name: str) -> dict:  # the chunk's first job waits at step 3 until released
        return {
            "ray.env_vars": {
                "RELAY_FAULT_PAUSE_AT": "after_step@3",
                "RELAY_FAULT_ONCE": str(faults / name),
                "RELAY_FAULT_PAUSE_S": "1200",
            }
        }

    write_spec(runs, name="cleared", **paused_at_step_3("cleared"))
    write_spec(runs, name="lost", **paused_at_step_3("lost"))
    write_spec(
        runs,
        name="frozen",
        **{
            "ray.env_vars": {"RELAY_FAULT_PAUSE_AT": "after_step@8", "RELAY_FAULT_ONCE": str(faults / "frozen")},
            "alerts.stall_minutes": 0.1,
        },
    )
    write_spec(
        runs,
        name="failing",
        **{
            "airflow.retries": 0,
            "alerts.webhook_conn_id": "relay_webhook",
            "ray.env_vars": {"RELAY_FAULT_KILL_AT": "after_step@8"},
        },
    )
    write_spec(runs, name="ahead", **{"chunks.handoff": "warm", "airflow.retries": 0})  # its validation held once
    write_spec(runs, name="errs", **{"chunks.handoff": "warm", "airflow.retries": 0})  # its validation's worker killed
    write_spec(runs, name="one", total_steps=6, chunk_steps=6, **{"airflow.retries": 0})  # a chunk each
    write_spec(runs, name="two", total_steps=6, chunk_steps=6, **{"airflow.retries": 0})

    # The worker that runs chunk 1 of the run named `lost` dies (SIGKILL) right after submitting its job; chunk 1's
    # validation of the run named `ahead` is held (its job, gone on warm into chunk 2, is not admitted meanwhile),
    # and that of the run named `errs` dies (an error, not a quarantine).
    with (
        postgres_database("relay_retries") as db_url,
        airflow_processes(
            base,
            runs,
            db_url,
            RELAY_FAULT_KILL_AT="after_submit:lost@1,validate:errs@1",
            RELAY_FAULT_PAUSE_AT="validate:ahead@1",
            RELAY_FAULT_ONCE=str(faults / "{point}"),
            **receivers["env"],
        ) as af,
    ):
        yield {**af, "runs": runs, "faults": faults}


def task(api, dag_id: str, run_id: str, task_id: str) -> dict:
    return next(t for t in api.task_instances(dag_id, run_id) if t["task_id"] == task_id)


def chunk_jobs(ray_address: str, run: str, since: float, chunk: int, spec: str | None = None) -> list:
    """Chunk `chunk`'s jobs of run `run` (of spec `spec` where given: another test's spec may name a run alike)."""
    return [
        j
        for j in jobs_of_run(ray_address, run, since)
        if (j.metadata or {}).get("relay_chunk") == str(chunk) and spec in (None, (j.metadata or {}).get("relay_spec"))
    ]


def trained_once_and_equal(spec_path: Path, run: str, uninterrupted: dict) -> tuple[Path, object]:
    """(run folder, store) of a run whose every step was trained once and that ended as the uninterrupted one."""
    spec = load_spec(spec_path, check_environment=False)
    run_dir = spec.run_dir(run)
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 13)), "each step trained once"
    assert not (run_dir / "metrics.superseded.jsonl").exists(), "no step was trained twice"
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), uninterrupted)
    return run_dir, store_for_spec(spec)


def adopted(api, ray_address, dag_id: str, run_id: str, run: str, since: float, release: Path) -> None:
    """The train task's second try defers on the job of its first, which is released only then (or when the
    check fails: a job held at its fault point would keep one of the session's Ray CPUs)."""
    try:
        wait_for(release.exists, 600, "the job to train (held at step 3)")  # on a busy head it may wait its turn
        wait_for(
            lambda: (t := task(api, dag_id, run_id, "chunk_01.train"))["try_number"] >= 2 and t["state"] == "deferred",
            600,
            "chunk 1's next try to defer",
        )
        jobs = chunk_jobs(ray_address, run, since, 1, dag_id.removeprefix("relay_"))
        assert [str(j.status) for j in jobs] == ["RUNNING"], "the first try's job was adopted, not stopped or doubled"
    finally:
        Path(f"{release}.go").touch()
    finished = api.wait_for_run(dag_id, run_id, timeout=900)
    assert finished["state"] == "success", api.task_instances(dag_id, run_id)
    assert [str(j.status) for j in chunk_jobs(ray_address, run, since, 1, dag_id.removeprefix("relay_"))] == ["SUCCEEDED"]
    assert task(api, dag_id, run_id, "chunk_01.train")["try_number"] == 2
    publish_overlapped_the_next_chunk(api, dag_id, run_id)


def publish_overlapped_the_next_chunk(api, dag_id: str, run_id: str) -> None:
    """Chunk 1's publish task ran while chunk 2's train task did (the README's pipelining)."""
    tis = {t["task_id"]: t for t in api.task_instances(dag_id, run_id)}
    publish, train = tis["chunk_01.publish"], tis["chunk_02.train"]
    assert publish["start_date"] < train["end_date"] and train["start_date"] < publish["end_date"], (
        f"chunk 1 published {publish['start_date']}..{publish['end_date']}, "
        f"chunk 2 trained {train['start_date']}..{train['end_date']}"
    )


@pytest.mark.fault
def test_a_cleared_train_task_adopts_its_healthy_job(airflow, ray_address, uninterrupted, fault_row):
    """A person clears chunk 1's deferred train task while its job trains (Airflow's own reason to fail a
    try): the job goes on, the next try defers on it, and 0 steps are lost."""
    api, dag_id, since = airflow["api"], "relay_cleared", time.time()
    api.wait_for_dag(dag_id)
    run_id = api.trigger(dag_id, {"run": "c"})["dag_run_id"]
    wait_for(
        lambda: (airflow["faults"] / "cleared").exists()
        and task(api, dag_id, run_id, "chunk_01.train")["state"] == "deferred",
        600,
        "chunk 1's job to train (held at step 3) with its task deferred",
    )
    api.clear_task_instances(dag_id, run_id, ["chunk_01.train"])
    adopted(api, ray_address, dag_id, run_id, "c", since, airflow["faults"] / "cleared")
    run_dir, store = trained_once_and_equal(airflow["runs"] / "cleared.yaml", "c", uninterrupted)
    fault_row(
        case="task-cleared",
        layer="full stack (Airflow's 4 processes on PostgreSQL, Ray, S3)",
        fault="a person clears chunk 1's deferred train task while its Ray job trains (held at step 3)",
        action="the trigger's on_kill saw a clear, not a mark, and left the job running; the task's next "
        "try found it holding the run's lease with a recent step and deferred on it: one job for "
        "the chunk, no step trained twice",
        steps_lost=0,
        run_dir=run_dir,
        store=store,
    )


@pytest.mark.fault
@pytest.mark.lane("faults")  # adopting a healthy job is CI's in the cleared task's case above
def test_a_worker_killed_between_submission_and_deferral_is_retried_onto_the_same_job(
    airflow, ray_address, uninterrupted, fault_row
):
    """The worker running chunk 1's train task is SIGKILLed right after it submitted the job, before it
    deferred or stored the job's id: the retry finds the job by its metadata and lease, and adopts it."""
    api, dag_id, since = airflow["api"], "relay_lost", time.time()
    api.wait_for_dag(dag_id)
    run_id = api.trigger(dag_id, {"run": "lost"})["dag_run_id"]
    wait_for(lambda: (airflow["faults"] / "after_submit:lost").exists(), 600, "the worker to be killed after submitting")
    adopted(api, ray_address, dag_id, run_id, "lost", since, airflow["faults"] / "lost")
    run_dir, store = trained_once_and_equal(airflow["runs"] / "lost.yaml", "lost", uninterrupted)
    fault_row(
        case="task-process-kill",
        layer="full stack (Airflow's 4 processes on PostgreSQL, Ray, S3)",
        fault="the process running chunk 1's train task is SIGKILLed right after submitting the Ray job, "
        "before it stored the job's id or deferred",
        action="Airflow retried the task; the retry found the job by its metadata (run, chunk) holding the "
        "lease taken at its submission, with a recent step, and deferred on it: one job, no step "
        "trained twice",
        steps_lost=0,
        run_dir=run_dir,
        store=store,
    )


@pytest.mark.fault
def test_a_dag_run_marked_failed_stops_its_job_training_ahead(airflow, ray_address, uninterrupted, fault_row):
    """Chunk 1's job went on warm into chunk 2, and nothing admits it yet (chunk 1's validation is held): a person
    marks the DAG run failed, as the UI does. Its `ahead` task's on_kill refuses the warm chunk: the job stops within
    60 s, nothing of chunk 2 committed; triggered again, the run resumes cold from step 6 and ends bitwise equal to
    an uninterrupted run."""
    api, dag_id, since = airflow["api"], "relay_ahead", time.time()
    run_dir = load_spec(airflow["runs"] / "ahead.yaml", check_environment=False).run_dir("ahead")
    api.wait_for_dag(dag_id)
    run_id = api.trigger(dag_id, {"run": "ahead"})["dag_run_id"]
    held = airflow["faults"] / "validate:ahead"
    try:
        # The `ahead` task's trigger runs in the triggerer (a mark before it does would find nothing to stop there:
        # the admission limit would): its log says at which step the job trains ahead.
        wait_for(
            lambda: held.exists()
            and task(api, dag_id, run_id, "chunk_01.ahead")["state"] == "deferred"
            and "ahead of its admission: step" in api.task_log(dag_id, run_id, "chunk_01.ahead"),
            600,
            "chunk 1's job training chunk 2 ahead, followed by chunk_01.ahead, its validation held",
        )
        marked = time.time()
        api.update_dag_run(dag_id, run_id, state="failed")
        wait_for(
            lambda: all(
                str(j.status) in ("STOPPED", "FAILED", "SUCCEEDED") for j in chunk_jobs(ray_address, "ahead", since, 1)
            ),
            60,
            "the job training ahead to end once its DAG run was marked failed",
        )
        took = time.time() - marked
    finally:
        Path(f"{held}.go").touch()  # the held validation goes on (its task was marked failed with the DAG run)
    committed = sorted(layout.step_dirs(run_dir))
    assert layout.read_tracker(run_dir) == 6 and max(committed) == 6, f"nothing of chunk 2 committed: {committed}"
    refused = [e for e in read_events(run_dir) if e["event"] == "handoff_refused"]
    # The mark fails the DAG run's running tasks too: the `ahead` task's on_kill, or its next poll of the held
    # validation (failed with the DAG run), refused the warm chunk.
    why = refused[-1]["why"] if refused else ""
    assert "marked failed by a person" in why or "its DAG run's chunk_01.validate (failed)" in why, refused

    again = api.trigger(dag_id, {"run": "ahead"})["dag_run_id"]
    finished = api.wait_for_run(dag_id, again, timeout=900)
    assert finished["state"] == "success", api.task_instances(dag_id, again)
    starts = [(e["chunk"], e["resumed_from"], e["warm"]) for e in read_events(run_dir) if e["event"] == "chunk_start"]
    assert starts == [(1, 0, False), (2, 6, True), (2, 6, False)], f"chunk 2 trained ahead, then cold from 6: {starts}"
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), uninterrupted)
    fault_row(
        case="warm-job-dag-run-failed",
        layer="full stack (Airflow's 4 processes on PostgreSQL, Ray, S3)",
        fault="a person marks the DAG run failed while its job trains the next chunk ahead of its admission",
        action=f"the chunk's `ahead` task's on_kill refused the warm chunk: the job stopped {took:.0f} s after the "
        "mark, nothing of chunk 2 committed; triggered again, the run resumed cold from step 6",
        steps_lost=len(read_jsonl(run_dir / "metrics.superseded.jsonl")),  # trained ahead, trained again
        run_dir=run_dir,
        store=store_for_spec(load_spec(airflow["runs"] / "ahead.yaml", check_environment=False)),
    )


@pytest.mark.fault
@pytest.mark.lane("faults")  # the `ahead` task's refusal is CI's in the DAG run marked failed above
def test_a_validation_that_errors_stops_the_job_training_ahead(airflow, ray_address, fault_row):
    """Chunk 1's validation errors (its worker is killed: nothing quarantined) while the chunk's job trains chunk 2
    ahead: the `ahead` task refuses the warm chunk, the job stops within 60 s without committing anything of it."""
    api, dag_id, since = airflow["api"], "relay_errs", time.time()
    run_dir = load_spec(airflow["runs"] / "errs.yaml", check_environment=False).run_dir("errs")
    api.wait_for_dag(dag_id)
    run_id = api.trigger(dag_id, {"run": "errs"})["dag_run_id"]
    wait_for(
        lambda: task(api, dag_id, run_id, "chunk_01.validate")["state"] == "failed", 600, "chunk 1's validation to fail"
    )
    failed_at = time.time()
    ended = ("STOPPED", "FAILED", "SUCCEEDED")
    wait_for(
        lambda: all(str(j.status) in ended for j in chunk_jobs(ray_address, "errs", since, 1)),
        60,
        "the job training ahead to end once the validation it went on from failed",
    )
    took = time.time() - failed_at
    finished = api.wait_for_run(dag_id, run_id, timeout=300)
    assert finished["state"] == "failed"
    assert task(api, dag_id, run_id, "chunk_01.ahead")["state"] == "failed", api.task_instances(dag_id, run_id)
    committed = sorted(layout.step_dirs(run_dir))
    assert layout.read_tracker(run_dir) == 6 and max(committed) == 6, f"nothing of chunk 2 committed: {committed}"
    refused = [e for e in read_events(run_dir) if e["event"] == "handoff_refused"]
    assert refused and "its DAG run's chunk_01.validate (failed)" in refused[-1]["why"], refused
    fault_row(
        case="warm-job-validation-error",
        layer="full stack (Airflow's 4 processes on PostgreSQL, Ray, S3)",
        fault="chunk 1's validation errors (its worker SIGKILLed; nothing quarantined) while its job trains chunk 2 ahead",
        action=f"the chunk's `ahead` task saw the validation failed and refused the warm chunk: the job stopped within "
        f"{took:.0f} s, nothing of chunk 2 committed; the DAG run failed with step 6 the run's latest",
        steps_lost=0,
        run_dir=run_dir,
        store=store_for_spec(load_spec(airflow["runs"] / "errs.yaml", check_environment=False)),
    )


@pytest.mark.fault
@pytest.mark.lane("faults")  # a stalled chunk stopped and retried is CI's in tests/airflow/test_alerts_dag.py
def test_a_frozen_job_is_still_stopped_and_resumed(airflow, ray_address, uninterrupted, fault_row):
    """Chunk 2's trainer is SIGSTOPped at step 8: no step for the stall limit (6 s), so the trigger stops it,
    and the retry does not adopt it: a new job resumes from step 6."""
    api, dag_id, since = airflow["api"], "relay_frozen", time.time()
    api.wait_for_dag(dag_id)
    run_id = api.trigger(dag_id, {"run": "f"})["dag_run_id"]
    marker = airflow["faults"] / "frozen"
    wait_for(lambda: marker.exists() and marker.read_text().strip(), 600, "chunk 2's job to reach step 8")
    os.kill(int(marker.read_text()), signal.SIGSTOP)
    Path(f"{marker}.go").touch()  # it would go on, but it is frozen
    finished = api.wait_for_run(dag_id, run_id, timeout=900)
    assert finished["state"] == "success", api.task_instances(dag_id, run_id)
    assert sorted(str(j.status) for j in chunk_jobs(ray_address, "f", since, 2)) == ["STOPPED", "SUCCEEDED"]
    run_dir = load_spec(airflow["runs"] / "frozen.yaml", check_environment=False).run_dir("f")
    resumed = [e["resumed_from"] for e in read_events(run_dir) if e["event"] == "chunk_start" and e.get("chunk") == 2]
    assert resumed == [6, 6]
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), uninterrupted)
    fault_row(
        case="job-frozen",
        layer="full stack (Airflow's 4 processes on PostgreSQL, Ray, S3)",
        fault="chunk 2's trainer is SIGSTOPped at step 8 (alive, no new step; stall limit 6 s)",
        action="the trigger saw no new step within the stall limit and stopped the job; the retry found no "
        "healthy job to adopt and a new job resumed from step 6",
        steps_lost=2,
        run_dir=run_dir,
        store=store_for_spec(load_spec(airflow["runs"] / "frozen.yaml", check_environment=False)),
    )


def test_every_failure_alerts_once_and_recovery_waits_for_the_failed_work(airflow, receivers):
    """Chunk 2 crashes at step 8 on every attempt. It fails, a person clears it, it fails again: two
    alerts. The run is triggered again: chunk 1 (done) finishes at once, chunk 2 fails a third time, and
    no "recovered" is sent on the way."""
    api, dag_id, sink = airflow["api"], "relay_failing", receivers["http"]
    api.wait_for_dag(dag_id)

    def alerts() -> list[dict]:
        return [a for a in sink.at("/alerts") if a.get("run") == "x"]

    first = api.trigger(dag_id, {"run": "x"})["dag_run_id"]
    assert api.wait_for_run(dag_id, first, timeout=900)["state"] == "failed"
    wait_for(lambda: len(alerts()) == 1, 30, lambda: f"one alert; arrived: {alerts()}")
    api.clear_task_instances(dag_id, first, ["chunk_02.train"])
    wait_for(
        lambda: api.dag_run(dag_id, first)["state"] == "failed"
        and task(api, dag_id, first, "chunk_02.train")["try_number"] == 2,
        600,
        "the cleared chunk to fail again",
    )
    wait_for(lambda: len(alerts()) == 2, 30, lambda: f"two alerts; arrived: {alerts()}")
    second = api.trigger(dag_id, {"run": "x"})["dag_run_id"]
    assert api.wait_for_run(dag_id, second, timeout=900)["state"] == "failed"
    wait_for(lambda: len(alerts()) == 3, 30, lambda: f"three alerts; arrived: {alerts()}")
    time.sleep(2)
    got = alerts()
    assert [(a["dag_run"], a["task"], a["kind"]) for a in got] == [
        (first, "chunk_02.train", got[0]["kind"]),
        (first, "chunk_02.train", got[0]["kind"]),
        (second, "chunk_02.train", got[0]["kind"]),
    ], got
    assert got[0]["kind"] != "recovered" and [a["try_number"] for a in got[:2]] == [1, 2]


def test_two_runs_in_a_one_slot_pool_never_train_at_the_same_time(airflow, ray_address):
    """Two specs in the one-slot relay_trainers pool, triggered together: their Ray jobs never overlap in
    time (the pool counts deferred train tasks: each job trains while its task is deferred)."""
    api, since = airflow["api"], time.time()
    runs = {}
    for name in ("one", "two"):
        api.wait_for_dag(f"relay_{name}")
    for name in ("one", "two"):
        runs[name] = api.trigger(f"relay_{name}", {"run": name})["dag_run_id"]
    for name, run_id in runs.items():
        assert api.wait_for_run(f"relay_{name}", run_id, timeout=900)["state"] == "success"

    jobs = sorted((j.start_time, j.end_time, name) for name in runs for j in jobs_of_run(ray_address, name, since))
    assert len(jobs) == 2, jobs
    for (_, end, a), (start, _, b) in itertools.pairwise(jobs):
        assert end <= start, f"a job of {a} ran until {end}, after one of {b} started at {start}"
