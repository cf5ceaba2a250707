"""The train task's decisions, as pure functions of facts read from the run's files and the task's try: each
returns a decision, and the front-end acts on it (alerts, asks, defers, fails). Ray Train's controller keeps
its failure policy apart from the loop the same way (`FailurePolicy.make_decision(status)`).

- the deadline: alert when the run's ETA is past `alerts.deadline` (it never fails the task);
- a fallback: ask a person before resuming below a quarantined checkpoint when more than
  `approvals.max_steps_lost` steps would be trained again;
- a failed job: fail the try (Airflow retries), wait out a backoff first, or stop for good, from its cause
  (relay.runs.failure_cause) and whether it repeats an earlier failure;
- the job itself (take over a warm one, re-attach, adopt, submit) is relay.jobs.submission.decide.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from relay.insights.eta import Eta
from relay.ops.approvals import Decision
from relay.runs import failure_cause

FALLBACK_APPROVED = "fallback_approved"  # events.jsonl: a person approved resuming below a quarantined step


Cause = failure_cause.Cause  # a failed job's classified cause (relay.runs.failure_cause), what a decision is made from


def cause_of(event: Mapping[str, Any] | None) -> Cause:
    """A cause as an event or an alert carries it (Cause.to_event); unknown without one."""
    return failure_cause.Cause(**(event or {"cause": failure_cause.UNKNOWN}))


def deadline_missed(found: Eta | None) -> bool:
    """Whether the run's ETA is past its deadline: alert (once; the alert ledger keeps it to one)."""
    return found is not None and (found.late_s or 0) > 0


@dataclass(frozen=True)
class Fallback:
    """A resume below quarantined checkpoints that needs a person's word."""

    run: str
    resume_from: int
    quarantined: tuple[int, ...]  # the quarantined steps above resume_from, oldest first
    allowed: int  # approvals.max_steps_lost, in steps
    quarantine_dir: str

    @property
    def newest(self) -> int:
        """The newest quarantined step: the approval names it."""
        return self.quarantined[-1]

    def decision(self) -> Decision:
        """The question a person answers in Airflow's Required Actions page."""
        k, n = self.resume_from, self.newest
        resume = f"Resume from step {k}"
        return Decision(
            "fallback",
            f"Resume run {self.run} from step {k}, {n - k} steps back?",
            f"Checkpoint(s) at step(s) {', '.join(map(str, self.quarantined))} failed validation and were quarantined "
            f"(their reports: `{self.quarantine_dir}`). The newest valid checkpoint is step {k}: resuming there trains "
            f"steps {k + 1}..{n} again, {n - k} steps, more than approvals.max_steps_lost ({self.allowed}).\n\n"
            f"**{resume}** to go on. **Stop the run** to look first: nothing is changed, and the next trigger asks again.",
            [resume, "Stop the run"],
            [resume],
            {"run": self.run, "quarantined": n, "resume_from": k},
        )


def fallback_to_approve(
    *,
    run: str,
    latest: int | None,
    quarantined_steps: Iterable[Any],
    approvals_on: bool,
    allowed: int,
    events: Iterable[Mapping[str, Any]],
    quarantine_dir: str = "",
) -> Fallback | None:
    """The fallback a person must approve before this chunk resumes from `latest`, or None: approvals are off,
    nothing above `latest` is quarantined, it loses no more than `allowed` steps, or a person approved resuming
    from `latest` past the newest quarantined step already (a `fallback_approved` event)."""
    k = latest or 0
    newer = tuple(sorted({q for q in quarantined_steps if isinstance(q, int) and q > k}))
    if not approvals_on or not newer or newer[-1] - k <= allowed:
        return None
    if any(
        e.get("event") == FALLBACK_APPROVED and e.get("quarantined") == newer[-1] and e.get("resume_from") == k
        for e in events
    ):
        return None
    return Fallback(run, k, newer, allowed, quarantine_dir)


@dataclass(frozen=True)
class FailureDecision:
    """What a failed try does: `fail` (Airflow retries while tries are left), `backoff` (wait backoff_s without a
    worker slot, then fail), or `stop` (fail for good: a retry cannot help)."""

    action: Literal["fail", "backoff", "stop"]
    policy: str  # failure_cause's: retry | backoff | stop
    why: str
    backoff_s: float = 0.0


def on_failure(
    cause: failure_cause.Cause,
    earlier: list[dict[str, Any]],
    *,
    retry_on: Mapping[str, str] | None,
    backoff_s: float,
    try_number: int,
    max_tries: int,
) -> FailureDecision:
    """The decision for a failed job of a chunk: the same exception at the same step as an earlier try of this
    DAG run stops (it is deterministic); otherwise the spec's `airflow.retry_on` for the cause (its default
    else); a backoff only where a retry is left and a backoff is set."""
    if failure_cause.repeats(cause, earlier):
        why = "the same exception at the same step as an earlier try: it is deterministic, so Airflow does not retry it"
        return FailureDecision("stop", failure_cause.STOP, why)
    policy = failure_cause.policy(cause, retry_on)
    why = f"policy for {cause.cause}: {policy} (spec airflow.retry_on)"
    if policy == failure_cause.STOP:
        return FailureDecision("stop", policy, why)
    if policy == failure_cause.BACKOFF and try_number <= max_tries and backoff_s:
        return FailureDecision("backoff", policy, why, backoff_s)
    return FailureDecision("fail", policy, why)


def after_stall(latest: int | None, *, try_number: int, max_tries: int) -> str:
    """What happens after a stalled job was stopped, in the stall alert's words."""
    if try_number <= max_tries:
        return f"Airflow's retry (try {try_number + 1} of {max_tries + 1}) resumes from step {latest or 0}"
    return f"no retries left: this DAG run stops; clear the task to resume from step {latest or 0}"
