"""A chunk's `ahead` task's trigger (relay.airflow.triggers.WarmJobTrigger) following the CPU trainer's real job on the
session's Ray head, once it went on warm from chunk 1 into chunk 2: what Airflow's API server says of the DAG run's
tasks is the one thing played here (the full stack's cases are in tests/e2e/test_retries.py).

- A clear of the task leaves the job training ahead; the job's wait for its admission is not a stall; the next
  chunk's train task skipped (a person rejected its decision) refuses the warm chunk: the job ends, nothing of chunk
  2 committed.
- A job that hangs while training ahead is a stall: the trigger fires STALLED at the step it hung after, refuses the
  warm chunk and stops the job through Ray once its grace is over.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from relay.airflow import triggers
from relay.jobs import submission
from relay.jobs.ray_jobs import TERMINAL, RayJobs
from relay.preflight.prepare import prepare_run
from relay.runs import handoff, heartbeat, layout
from relay.runs.metrics import read_events
from relay.spec.run_spec import load_spec
from support.helpers import write_spec
from support.polling import wait_for

pytestmark = pytest.mark.services

FROM_STEP = 3  # chunk 1 ends here, and its job goes on warm into chunk 2 (steps 4..6)


def _warm_job(tmp_path: Path, ray_address: str, name: str, env: dict[str, str]) -> tuple[RayJobs, str, Path]:
    """Chunk 1 of a three-chunk run, submitted as the DAG's train task does (handoff on): its job, once it committed
    step 3 and went on warm into chunk 2."""
    spec = load_spec(
        write_spec(tmp_path, name=name, total_steps=9, chunk_steps=FROM_STEP, s3=None, **{"chunks.handoff": "warm"}),
        check_environment=True,
    )
    run = prepare_run(spec, name, started_by="test").run(spec)
    jobs = RayJobs(ray_address)
    sub_id = f"{name}-{time.time_ns()}"
    submission.submit_chunk(jobs, run, FROM_STEP, sub_id, chunk=1, metadata=lambda req: {}, env=env, handoff=True)
    wait_for(lambda: handoff.went_on(run.dir, 2, sub_id), 300, f"job {sub_id} to go on warm into chunk 2")
    return jobs, sub_id, run.dir


def _trigger(ray_address: str, sub_id: str, run_dir: Path, **kw) -> triggers.WarmJobTrigger:
    return triggers.WarmJobTrigger(
        address=ray_address,
        submission_id=sub_id,
        run_dir=str(run_dir),
        chunk=2,
        deadline=time.time() + 300,
        poll_seconds=0.3,
        watched=["chunk_01.validate", "chunk_02.train"],
        from_step=FROM_STEP,
        **kw,
    )


def _api_says(monkeypatch, states: dict[str, str]) -> None:
    """What the API server says of the DAG run's tasks ("" is the trigger's own), as the test sets it."""

    async def task_states(trigger, task_ids):
        return {t: states[t] for t in task_ids if t in states} if task_ids is not None else {"": states[""]}

    monkeypatch.setattr(triggers, "_task_states", task_states)


async def _first_event(trigger: triggers.WarmJobTrigger, within_s: float):
    """The trigger's first event, or None if it fires none within `within_s` (it is then closed)."""
    events = trigger.run()
    try:
        return (await asyncio.wait_for(anext(events), within_s)).payload
    except TimeoutError:
        return None
    finally:
        await events.aclose()


def _ended(jobs: RayJobs, sub_id: str) -> str | None:
    state = jobs.get(sub_id)
    return state.status if state is not None and state.status in TERMINAL else None


def _nothing_of_chunk_2(run_dir: Path) -> None:
    assert layout.read_tracker(run_dir) == FROM_STEP and max(layout.step_dirs(run_dir)) == FROM_STEP


def test_a_clear_leaves_the_job_training_ahead_and_a_rejection_stops_it(tmp_path, ray_address, monkeypatch):
    held = tmp_path / "held"  # the job pauses after step 5 (chunk 2's second step) until held.go exists
    jobs, sub_id, run_dir = _warm_job(
        tmp_path, ray_address, "ahead", {"RELAY_FAULT_PAUSE_AT": "after_step@5", "RELAY_FAULT_ONCE": str(held)}
    )
    try:
        states = {"": "scheduled", "chunk_01.validate": "running", "chunk_02.train": "none"}
        _api_says(monkeypatch, states)
        wait_for(held.exists, 120, "the job to train chunk 2 ahead (held after step 5)")

        asyncio.run(_trigger(ray_address, sub_id, run_dir).on_kill())  # cleared: the task is scheduled again
        assert handoff.answer(run_dir, 2, sub_id) is None, "a clear refuses nothing"
        assert _ended(jobs, sub_id) is None, "the job trains ahead on"

        Path(f"{held}.go").touch()
        wait_for(lambda: heartbeat.read(run_dir, sub_id) == (2 * FROM_STEP, True), 120, "the job to wait for its admission")
        # Waiting at step 6's save for longer than the stall limit: its admission limit bounds that, not the stall watch.
        follow = _trigger(ray_address, sub_id, run_dir, stall_after_s=1.0, stop_grace_s=30)
        assert asyncio.run(_first_event(follow, 4.0)) is None

        states["chunk_01.validate"], states["chunk_02.train"] = "success", "skipped"  # a person rejected its decision
        event = asyncio.run(_first_event(follow, 60.0))
        assert event is not None and event["status"] == triggers.REFUSED and event["by"] == "this task", event
        assert "its DAG run's chunk_02.train (skipped)" in event["message"] and "the job ended" in event["message"], event
    finally:
        Path(f"{held}.go").touch()
        jobs.stop(sub_id)
    _nothing_of_chunk_2(run_dir)
    refused = [e for e in read_events(run_dir) if e["event"] == "handoff_refused"]
    assert [e["chunk"] for e in refused] == [2] and "chunk_02.train (skipped)" in refused[0]["why"], refused


def test_a_job_that_hangs_while_training_ahead_is_a_stall(tmp_path, ray_address, monkeypatch):
    held = tmp_path / "hung"  # the job hangs after step 5 and never goes on
    jobs, sub_id, run_dir = _warm_job(
        tmp_path, ray_address, "hung", {"RELAY_FAULT_PAUSE_AT": "after_step@5", "RELAY_FAULT_ONCE": str(held)}
    )
    try:
        _api_says(monkeypatch, {"": "deferred", "chunk_01.validate": "success", "chunk_02.train": "none"})
        wait_for(held.exists, 120, "the job to hang after step 5, training chunk 2 ahead")
        limit = 3.0
        t0 = time.time()
        event = asyncio.run(
            _first_event(_trigger(ray_address, sub_id, run_dir, stall_after_s=limit, stop_grace_s=2.0), 60.0)
        )
        assert event is not None and event["status"] == triggers.STALLED, event
        assert event["step"] == 5 and "no new step" in event["message"] and "while training ahead" in event["message"]
        assert "stopped through Ray" in event["message"], "it could not stop at a step boundary: stopped through Ray"
        assert time.time() - t0 < limit + 2.0 + 15, "stopped within its limit and grace"
        wait_for(lambda: _ended(jobs, sub_id) is not None, 60, "the hung job to end")
    finally:
        Path(f"{held}.go").touch()
        jobs.stop(sub_id)
    _nothing_of_chunk_2(run_dir)
    got = handoff.answer(run_dir, 2, sub_id)
    assert got is not None and got["admitted"] is False and "while training ahead" in got["why"], got


@pytest.mark.fault
def test_a_dag_run_marked_failed_while_its_warm_job_waits_for_admission_stops_it(
    tmp_path, ray_address, monkeypatch, fault_row
):
    """The job trained chunk 2 ahead and waits, at step 6's save, for its admission; a person marks the DAG run failed
    (Airflow fails its deferred `ahead` task and calls the trigger's on_kill): the warm chunk is refused and the job
    ends without committing anything of it."""
    jobs, sub_id, run_dir = _warm_job(tmp_path, ray_address, "waits", {})
    try:
        wait_for(lambda: heartbeat.read(run_dir, sub_id) == (2 * FROM_STEP, True), 120, "the job to wait at step 6")
        _api_says(monkeypatch, {"": "failed", "chunk_01.validate": "running", "chunk_02.train": "none"})
        marked = time.time()
        asyncio.run(_trigger(ray_address, sub_id, run_dir, stop_grace_s=30).on_kill())
        wait_for(lambda: _ended(jobs, sub_id), 60, "the job to end once its DAG run was marked failed")
        took = time.time() - marked
    finally:
        jobs.stop(sub_id)
    _nothing_of_chunk_2(run_dir)
    refused = [e for e in read_events(run_dir) if e["event"] == "handoff_refused"]
    assert len(refused) == 1 and "marked failed by a person" in refused[0]["why"], refused
    fault_row(
        case="warm-job-failed-waiting",
        layer="Ray job (the `ahead` task's trigger; Airflow's API server played)",
        fault="a person marks the DAG run failed while chunk 1's job, gone on warm into chunk 2, waits at step 6's "
        "save for its admission",
        action=f"the trigger's on_kill refused the warm chunk: the job ended {took:.0f} s after the mark, nothing of "
        "chunk 2 committed (the tracker stayed at 3); the next DAG run resumes cold from step 3",
        steps_lost=FROM_STEP,  # chunk 2's steps, trained ahead
        run_dir=run_dir,
    )
