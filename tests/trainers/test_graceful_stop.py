"""Graceful stops (relay.trainers.stopping): a trainer that gets SIGTERM finishes its step, commits a checkpoint
of it and exits 4 (cause preempted): the retry resumes there with no step lost, and the run ends bitwise equal
to an uninterrupted one. The spec's save_before ends a chunk early enough to save before the deadline.

- `relay train` SIGTERMed while it trains (a pod's end, a spot notice);
- the chunk's Ray job stopped with `ray job stop` (Ray's SIGTERM, then its SIGKILL after
  RAY_JOB_STOP_WAIT_TIME_S, which Relay sets to ray.stop_grace_seconds);
- a save_before deadline too close to train a step: nothing trained, nothing lost.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from relay.common.errors import SpecError
from relay.common.faultpoint import FAULT_ENV
from relay.jobs import chunk_job, submission
from relay.jobs.ray_jobs import TERMINAL, RayJobs
from relay.preflight.prepare import prepare_run
from relay.runs import failure_cause, layout
from relay.runs.metrics import read_events
from relay.spec.run_spec import deadline_seconds, load_spec
from relay.trainers.session import last_save_seconds
from relay.trainers.stopping import GracefulStop, request_stop, time_needed
from support.faults import ForkServer, assert_finished_as, wait_for_line
from support.helpers import read_metrics, relay_cli, write_spec

STEPS = 12


# ------------------------------------------------------------------------------ what asks for a stop


def test_save_before_is_a_time_with_its_zone_or_a_variable(tmp_path, monkeypatch):
    assert deadline_seconds("2026-12-03T18:00:00Z") == 1796320800.0
    assert deadline_seconds("1796320800") == 1796320800.0
    monkeypatch.setenv("RESERVATION_END", "2026-12-03T20:00:00+02:00")
    assert deadline_seconds("${RESERVATION_END}") == 1796320800.0
    assert deadline_seconds("${NOT_SET_HERE:-}") is None
    with pytest.raises(SpecError) as unset:
        deadline_seconds("${NOT_SET_HERE}")
    assert unset.value.key == "save_before" and "NOT_SET_HERE" in str(unset.value)
    for bad, said in (("2026-12-03T18:00:00", "no time zone"), ("tomorrow", "is not a time")):
        with pytest.raises(SpecError) as e:
            load_spec(write_spec(tmp_path, name="bad", save_before=bad), check_environment=False)
        assert "save_before" in str(e.value) and said in str(e.value), str(e.value)
    spec = load_spec(write_spec(tmp_path, name="later", save_before="${RESERVATION_END}"), check_environment=False)
    assert spec.deadline() == 1796320800.0, "a variable is read where the trainer runs"


def test_a_stop_file_and_a_near_deadline_ask_for_a_stop_and_a_far_one_does_not(tmp_path):
    far = GracefulStop(tmp_path, "relay-t-a-c01-t1", time.time() + 3600, signals=False)
    assert far.check([1.0, 2.0], 5.0) is None
    request_stop(tmp_path, "relay-t-a-c01-t1", "SIGTERM")
    assert far.check([1.0, 2.0], 5.0) == "a stop request (SIGTERM)"

    near = GracefulStop(tmp_path, "other", time.time() + 20, signals=False)
    assert time_needed([1.0, 30.0, 2.0], 5.0) == pytest.approx(42.0)  # the slowest recent step, a save, 20% spare
    why = near.check([1.0, 30.0, 2.0], 5.0)
    assert why and why.startswith("save_before ") and "another step and a save need about 42s" in why
    assert GracefulStop(tmp_path, "unmeasured", time.time() + 30, signals=False).check([], None), (
        "with no save measured yet, a save is taken to need a minute"
    )


# ------------------------------------------------------------------------------ real processes


@pytest.mark.services
@pytest.mark.fault
def test_relay_train_sigtermed_mid_chunk_saves_its_step_and_the_resume_loses_none(
    baseline, uninterrupted, tmp_path, fault_row
):
    spec, _ = baseline
    run_dir = tmp_path / "run"
    server = ForkServer()
    try:
        assert (
            server.run(
                ["train", str(spec), "--to-step", "6", "--checkpoint-dir", str(run_dir), "--offline"], tmp_path / "c1.log"
            )
            == 0
        )
        # Chunk 2 holds after step 8 until told to go on: the SIGTERM lands while it trains.
        marker = tmp_path / "held"
        log = tmp_path / "c2.log"
        pid = server.start(
            ["train", str(spec), "--to-step", str(STEPS), "--checkpoint-dir", str(run_dir), "--offline"],
            log,
            {FAULT_ENV: "after_step@8", "RELAY_FAULT_ONCE": str(marker)},
        )
        wait_for_line(log, "[relay-fault] paused at after_step step 8", pid)
        os.kill(pid, signal.SIGTERM)
        wait_for_line(log, "[relay] SIGTERM: finishing this step", pid)
        Path(f"{marker}.go").touch()
        rc = server.wait(pid)
        out = log.read_text()
        assert rc == 4, out[-3000:]
        assert "relay: stopped after step 8 (SIGTERM): its checkpoint global_step_8 is committed, no step lost" in out
        assert layout.read_tracker(run_dir) == 8 and [r["step"] for r in read_metrics(run_dir)] == list(range(1, 9))
        stops = [e for e in read_events(run_dir) if e["event"] == "chunk_stopped"]
        assert [(e["step"], e["reason"]) for e in stops] == [(8, "SIGTERM")]
        assert not (run_dir / "metrics.superseded.jsonl").exists(), "nothing to train again"

        # The retry resumes from step 8: no step lost, and the run ends as the uninterrupted one.
        assert (
            server.run(
                ["train", str(spec), "--to-step", str(STEPS), "--checkpoint-dir", str(run_dir), "--offline"],
                tmp_path / "c3.log",
            )
            == 0
        )
        assert "resumes from step 8" in (tmp_path / "c3.log").read_text()
        assert_finished_as(run_dir, uninterrupted, STEPS)
        assert not (run_dir / "metrics.superseded.jsonl").exists(), "0 steps lost"
    finally:
        server.close()
    fault_row(
        case="graceful-stop",
        fault="`relay train` gets SIGTERM while it trains step 8 of chunk 2",
        action="the trainer finished step 8, committed global_step_8 under the lease, recorded chunk_stopped and "
        "exited 4 (cause preempted); the next `relay train` resumed from step 8 and the run ended bitwise "
        "equal to the uninterrupted one",
        steps_lost=0,
        run_dir=run_dir,
    )


@pytest.mark.processes
def test_a_save_before_too_close_for_a_step_ends_the_chunk_at_once_and_loses_nothing(tmp_path):
    soon = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 5))
    spec = write_spec(tmp_path, save_before=soon)
    run_dir = tmp_path / "soon"
    r = relay_cli("train", str(spec), "--to-step", "6", "--checkpoint-dir", str(run_dir), "--offline")
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert "stopped before training a step (save_before " in r.stderr and "no step lost" in r.stderr, r.stderr
    assert layout.read_tracker(run_dir) is None
    assert not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir), "no step was trained"
    # The same run without a deadline (an unset variable with an empty default) trains on from step 0.
    later = write_spec(tmp_path / "later", save_before="${RELAY_NO_DEADLINE:-}")
    r = relay_cli("train", str(later), "--to-step", "2", "--checkpoint-dir", str(run_dir), "--offline")
    assert r.returncode == 0 and layout.read_tracker(run_dir) == 2, r.stderr[-2000:]


@pytest.mark.services
@pytest.mark.fault
def test_a_chunk_job_stopped_with_ray_job_stop_saves_its_step_and_is_classified_preempted(
    ray_address, uninterrupted, tmp_path, fault_row
):
    spec = load_spec(write_spec(tmp_path), check_environment=True)
    run = prepare_run(spec, "g", started_by="test").run(spec)
    jobs = RayJobs(ray_address)
    sub_id = chunk_job.local_submission_id(run)
    req = submission.chunk_request(run, 6, sub_id, chunk=chunk_job.chunk_index(run.spec, 6), restore=False)
    marker = tmp_path / "held"
    jobs.submit(req, sub_id, chunk_job.metadata(req), {FAULT_ENV: "after_step@4", "RELAY_FAULT_ONCE": str(marker)})
    try:
        deadline = time.time() + 300
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.1)
        assert marker.exists(), jobs.log_tail(sub_id)
        jobs.stop(sub_id)  # Ray: SIGTERM now, SIGKILL after the spec's stop_grace_seconds
        while "[relay] SIGTERM: finishing this step" not in jobs.logs(sub_id) and time.time() < deadline:
            time.sleep(0.1)
    finally:
        Path(f"{marker}.go").touch()
    while (state := jobs.get(sub_id)).status not in TERMINAL and time.time() < deadline:
        time.sleep(0.2)
    log = jobs.logs(sub_id)
    assert state.status == "STOPPED", log[-3000:]
    assert f"[relay] chunk {req.chunk} of run {req.run} stopped early: stopped after step 4 (SIGTERM)" in log, log[-3000:]
    assert layout.read_tracker(run.dir) == 4 and last_save_seconds(run.dir) is not None
    cause = failure_cause.classify(
        state.status,
        state.message,
        jobs.log_tail(sub_id),
        state.exit_code,
        step=failure_cause.step_of_failure(run.dir, sub_id),
    )
    assert cause.cause == failure_cause.PREEMPTED and failure_cause.policy(cause) == failure_cause.RETRY, cause.report()
    assert any("stopped after step 4" in line for line in cause.evidence), cause.evidence

    r = relay_cli("train", str(spec.source), "--to-step", str(STEPS), "--run", "g")
    assert r.returncode == 0 and "resumes from step 4" in r.stdout, r.stderr[-3000:]
    assert_finished_as(run.dir, uninterrupted, STEPS)
    assert not (run.dir / "metrics.superseded.jsonl").exists(), "0 steps lost"
    fault_row(
        case="graceful-stop",
        layer="Ray job",
        fault="`ray job stop` of a chunk's job in step 4 (Ray's SIGTERM, its SIGKILL after ray.stop_grace_seconds)",
        action="the trainer finished step 4 and committed it within the grace; the job ended STOPPED, classified "
        "preempted from its log (retry); the resume from step 4 ended bitwise equal to the "
        "uninterrupted run",
        steps_lost=0,
        run_dir=run.dir,
        store=None,
    )
