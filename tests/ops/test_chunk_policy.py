"""The train task's decisions, without Airflow: what a failed try does, when a person must approve a fallback,
when the deadline alerts, and what the stall alert says comes next."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relay.insights.eta import Eta
from relay.ops import chunk_policy as policy
from relay.runs.failure_cause import Cause


def test_the_decisions_import_without_airflow():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, relay.ops.chunk_policy, relay.ops.train_chunk; print('airflow' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


EXC_AT_5 = {"cause": "exception", "step": 5, "signature": "ValueError: bad reward"}


@pytest.mark.parametrize(
    ("cause", "earlier", "retry_on", "backoff_s", "try_number", "max_tries", "action", "why"),
    [
        # the cause's default: an exception retries, host OOM backs off, accelerator OOM stops
        (Cause("exception", 5, signature="ValueError: bad reward"), [], None, 60, 1, 2, "fail", "exception: retry"),
        (Cause("host_oom", 3), [], None, 60, 1, 2, "backoff", "host_oom: backoff"),
        (Cause("accelerator_oom", 3), [], None, 60, 1, 2, "stop", "accelerator_oom: stop"),
        # a backoff only while a retry is left, and only with a backoff set
        (Cause("host_oom", 3), [], None, 60, 3, 2, "fail", "host_oom: backoff"),
        (Cause("host_oom", 3), [], None, 0, 1, 2, "fail", "host_oom: backoff"),
        # the spec's airflow.retry_on overrides the default
        (Cause("accelerator_oom", 3), [], {"accelerator_oom": "retry"}, 60, 1, 2, "fail", "accelerator_oom: retry"),
        (Cause("preempted"), [], {"preempted": "stop"}, 60, 1, 2, "stop", "preempted: stop"),
        # what Relay's own error said: a retry cannot help stops, whatever the cause's default
        (Cause("exception", 2, retry_helps=False), [], None, 60, 1, 2, "stop", "exception: stop"),
        # the same exception at the same step as an earlier try stops: it is deterministic
        (Cause("exception", 5, signature="ValueError: bad reward"), [EXC_AT_5], None, 60, 2, 2, "stop", "deterministic"),
        # ... but not at another step, nor another exception
        (Cause("exception", 6, signature="ValueError: bad reward"), [EXC_AT_5], None, 60, 2, 2, "fail", "exception: retry"),
        (Cause("exception", 5, signature="KeyError: 'x'"), [EXC_AT_5], None, 60, 2, 2, "fail", "exception: retry"),
    ],
)
def test_a_failed_try_fails_backs_off_or_stops_as_its_cause_says(
    cause, earlier, retry_on, backoff_s, try_number, max_tries, action, why
):
    got = policy.on_failure(
        cause, earlier, retry_on=retry_on, backoff_s=backoff_s, try_number=try_number, max_tries=max_tries
    )
    assert got.action == action
    assert why in got.why
    assert got.backoff_s == (backoff_s if action == "backoff" else 0.0)


APPROVED_5_FROM_2 = {"event": "fallback_approved", "quarantined": 5, "resume_from": 2}


@pytest.mark.parametrize(
    ("latest", "quarantined", "approvals_on", "allowed", "events", "asks"),
    [
        (2, [5], True, 2, [], (2, (5,))),  # 3 steps lost > 2 allowed: ask
        (2, [4], True, 2, [], None),  # 2 steps lost: within what is allowed
        (2, [5], False, 2, [], None),  # approvals off
        (2, [1, 2], True, 0, [], None),  # nothing quarantined above the resume point
        (2, [5], True, 2, [APPROVED_5_FROM_2], None),  # already approved
        (2, [5, 8], True, 2, [APPROVED_5_FROM_2], (2, (5, 8))),  # a newer quarantine asks again
        (None, [3, "7", None], True, 2, [], (0, (3,))),  # a fresh resume; malformed steps are ignored
    ],
)
def test_a_fallback_asks_a_person_only_past_what_the_spec_allows(latest, quarantined, approvals_on, allowed, events, asks):
    got = policy.fallback_to_approve(
        run="r1",
        latest=latest,
        quarantined_steps=quarantined,
        approvals_on=approvals_on,
        allowed=allowed,
        events=events,
        quarantine_dir="/runs/r1/.relay/quarantine",
    )
    assert (got and (got.resume_from, got.quarantined)) == asks
    if got is not None:
        decision = got.decision()
        assert decision.kind == "fallback" and decision.proceed == [f"Resume from step {got.resume_from}"]
        assert decision.data == {"run": "r1", "quarantined": got.newest, "resume_from": got.resume_from}
        assert (
            "/runs/r1/.relay/quarantine" in decision.body
            and f"more than approvals.max_steps_lost ({allowed})" in decision.body
        )


def _eta(at: float, deadline: float | None) -> Eta:
    return Eta(now=0, at=at, steps_left=10, step_s=1, chunks_left=1, boundary_s=0, deadline=deadline)


@pytest.mark.parametrize(
    ("found", "alerts"),
    [(None, False), (_eta(100, None), False), (_eta(100, 200), False), (_eta(100, 100), False), (_eta(201, 200), True)],
)
def test_the_deadline_alerts_only_when_the_eta_is_past_it(found, alerts):
    assert policy.deadline_missed(found) is alerts


@pytest.mark.parametrize(
    ("try_number", "max_tries", "says"),
    [
        (1, 2, "Airflow's retry (try 2 of 3) resumes from step 4"),
        (3, 2, "no retries left: this DAG run stops; clear the task to resume from step 4"),
    ],
)
def test_a_stall_says_what_comes_next(try_number, max_tries, says):
    assert policy.after_stall(4, try_number=try_number, max_tries=max_tries) == says


def test_the_gates_verdict_names_the_failed_check_and_what_to_do():
    from relay.ops.validate_chunk import verdict
    from relay.spec.plan import ChunkPlan

    chunk = ChunkPlan(12, 6).chunk(2)
    good = {"ok": True, "checks": [{"name": "structure", "ok": True, "detail": "complete"}]}
    assert verdict(chunk, good) == verdict(chunk, good) and verdict(chunk, good).ok
    bad = {
        "ok": False,
        "checks": [
            {"name": "structure", "ok": True, "detail": "complete for world size 1 (FSDP2)"},
            {"name": "integrity", "ok": False, "detail": "actor/model_world_size_1_rank_0.pt: sha256 differs"},
        ],
        "quarantined_to": "/runs/r/.relay/quarantine/global_step_12",
        "fell_back_to": 6,
    }
    got = verdict(chunk, bad)
    assert not got.ok and got.failed == "integrity: actor/model_world_size_1_rank_0.pt: sha256 differs"
    assert got.report.splitlines() == [
        "  ✔ structure: complete for world size 1 (FSDP2)",
        "  ✘ integrity: actor/model_world_size_1_rank_0.pt: sha256 differs",
    ]
    assert "pointed the tracker at step 6" in got.action and "Clear chunk_02.train" in got.action
    assert "step none" in verdict(chunk, {**bad, "fell_back_to": None}).action
