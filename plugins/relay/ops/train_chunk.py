"""A chunk's training, as the steps its train task takes: each reads or writes the run's files and returns what
the front-end acts on (relay.airflow.operators.RayChunkOperator logs, alerts, defers and fails; `relay train`
shares the job's decision and submission through relay.jobs.submission).

  finish            the chunk is done when the run's latest valid checkpoint reached its end step
  check             the checks before a chunk (settings, data); a refused chunk refuses a warm job too
  fallback          a resume below quarantined checkpoints a person must approve (chunk_policy.fallback_to_approve)
  job / start       take over a warm job, re-attach, adopt, or stop the run's other jobs and submit under its lease
  watch             what the job's trigger follows: deadline, stall limits, warm handoff
  notices           the alerts a job's end asks for: fallbacks at its resume, a stall
  failure           a failed job's cause and what the try does about it (chunk_policy.on_failure)

`Try` is the Airflow task try a step runs in, as plain values (its DAG run, try number, tries, task, conf).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from relay.alerts import stall_limit_s
from relay.checkpoints.preview import inspect_dir
from relay.checkpoints.resume import QUARANTINE, quarantined
from relay.checkpoints.validate import latest_step_or_problem, latest_valid_step
from relay.common.errors import LeaseLost, RelayError
from relay.common.faultpoint import drill_env, fault_point
from relay.common.timestamps import epoch
from relay.insights.audit import AuditReport, audit
from relay.insights.eta import Eta, eta
from relay.jobs import submission
from relay.jobs.ray_jobs import STOP_MARGIN_S, RayJobs, job_metadata, submission_id
from relay.ops import chunk_policy, elastic, follow_job
from relay.ops.approvals import Answer
from relay.preflight.checks import before_chunk
from relay.runs import failure_cause, handoff, node_oom
from relay.runs.layout import relay_dir
from relay.runs.metrics import read_events
from relay.runs.phases import record_job_times, record_phase
from relay.runs.run import Run
from relay.spec.kinds import WorldOption
from relay.spec.plan import Chunk
from relay.spec.run_spec import deadline_seconds

TRIGGER_TIMEOUT_MARGIN_S = 10.0  # Airflow's defer timeout comes this long after the trigger's own deadline handling


@dataclass(frozen=True)
class Try:
    """The Airflow task try a step runs in: its DAG run, try number, the tries it may take, its task and the
    DAG run's conf."""

    dag_run: str
    number: int
    max_tries: int
    task: str
    conf: Mapping[str, Any] | None = None

    def by(self) -> str:
        """The try, in an event's words."""
        return f"{self.task} try {self.number} of DAG run {self.dag_run}"


class JobEnded(RelayError):
    """This try's own job already ended without success: the try fails and the next one resumes."""

    retry_helps = True


class NotReached(RelayError):
    """A chunk's job ended, but the run's latest valid checkpoint is short of the chunk's end step."""

    retry_helps = True  # the retry resumes from that checkpoint


@dataclass(frozen=True)
class Finished:
    """A chunk that is done: the latest valid step, the replay audit of the steps trained twice, the run's ETA
    against its deadline, and the task's result."""

    latest: int | None
    replay: AuditReport
    eta: Eta | str | None  # against alerts.deadline (see eta_now)
    result: dict[str, Any]


def finish(run: Run, chunk: Chunk, how: str) -> Finished:
    """The chunk is done when the latest valid checkpoint reached its end step; NotReached otherwise (the retry
    resumes from that checkpoint)."""
    latest = latest_valid_step(run.dir)
    if not chunk.done_by(latest):
        raise NotReached(
            f"{chunk} of run {run}: the job ended but the latest valid checkpoint is step {latest}, not {chunk.end_step}",
            f"the retry resumes from step {latest or 0}",
        )
    result = {"run_name": run.name, "chunk": chunk.index, "end_step": chunk.end_step, "latest_step": latest, "how": how}
    return Finished(latest, audit(run.dir, run.spec.audit.tolerance), eta_now(run, latest), result)


def eta_now(run: Run, latest: int | None) -> Eta | str | None:
    """The run's ETA against alerts.deadline (None without one); a string says why there is none."""
    spec = run.spec
    if not spec.alerts.deadline:
        return None
    try:
        deadline = deadline_seconds(spec.alerts.deadline, spec.source, "alerts.deadline")
        if deadline is None:
            return None
        return eta(
            run.dir, total_steps=spec.total_steps, chunk_steps=spec.chunk_steps, latest_step=latest or 0, deadline=deadline
        )
    except RelayError as e:
        return f"no ETA against alerts.deadline: {e}"


@dataclass
class Checked:
    """The checks before a chunk: the source changes training goes on without (use_frozen), or the error that
    refuses the chunk (and the warm job refused with it)."""

    source_changes: list[str] = field(default_factory=list)
    error: RelayError | None = None
    warm_refused: str | None = None


def check(run: Run, chunk: Chunk, *, allow_drift: list[str], dag_run: str) -> Checked:
    """Settings drift and changed sources are caught before the chunk's job starts, every chunk. A refused chunk
    also refuses a job that went on warm into it: it stops without committing."""
    try:
        checked = before_chunk(run, allow_drift=allow_drift, dag_run=dag_run)
    except RelayError as e:
        return Checked(error=e, warm_refused=handoff.refuse(run.dir, chunk.index, e.what))
    return Checked(source_changes=list(checked["source_changes"]))


def resume_preview(run: Run, chunk: Chunk, latest: int | None) -> str:
    """What the job will load, as `relay checkpoint inspect` shows it (small files only)."""
    if not latest:
        return f"{chunk} of run {run} starts at step 0: no checkpoint to resume from"
    try:
        return f"{chunk} of run {run} {inspect_dir(run.dir, latest, verify=False).one_line()}"
    except RelayError as e:  # the trainer validates again, quarantines and falls back
        return f"{chunk} of run {run}: no resume preview: {e.what}"


def fallback(run: Run, latest: int | None) -> chunk_policy.Fallback | None:
    """The fallback below quarantined checkpoints this chunk's resume needs a person to approve, or None."""
    spec = run.spec
    return chunk_policy.fallback_to_approve(
        run=run.name,
        latest=latest,
        quarantined_steps=[q.get("step") for q in quarantined(run.dir)],
        approvals_on=spec.airflow.approvals,
        allowed=spec.approvals.steps_allowed(spec.chunk_steps),
        events=read_events(run.dir),
        quarantine_dir=str(relay_dir(run.dir, QUARANTINE)),
    )


def approve_fallback(run: Run, chunk: Chunk, got: Answer) -> None:
    """Record a person's approval of a fallback (events.jsonl), so that the chunk's next try goes on."""
    run.folder.record(
        chunk_policy.FALLBACK_APPROVED,
        chunk=chunk.index,
        quarantined=got.data["quarantined"],
        resume_from=got.data["resume_from"],
        by=got.by,
        at=got.at,
    )


def job(
    jobs: RayJobs, run: Run, chunk: Chunk, at: Try, *, remembered: str | None, warn: Callable[[str], None]
) -> submission.JobDecision:
    """What this try does about its chunk's job (relay.jobs.submission.decide); JobEnded when this try's own job
    already ended without success. An elastic run's warm job is refused when the cluster could hold a larger world
    size now: the chunk starts cold and grows."""
    sub_id = submission_id(run.spec.name, run.name, at.dag_run, chunk.index, at.number)
    decided = submission.decide(
        jobs,
        run,
        chunk,
        sub_id,
        stall_limit_s=stall_limit_s(run),
        warn=warn,
        remembered=remembered,
        grow=elastic.grow(run, jobs.address),
    )
    if decided.action == "ended" and decided.state is not None:
        raise JobEnded(
            f"Ray job {sub_id} of this try already ended {decided.state.status}: {decided.state.message}",
            "the next try resumes from the latest checkpoint",
        )
    return decided


@dataclass(frozen=True)
class Started:
    """The job this try follows now, in a log's words; `remember`: store its id in Airflow's task state (kept
    across tries), `stopped`: the run's other jobs stopped before a submission (one writer per run)."""

    how: str
    remember: bool
    stopped: list[str] = field(default_factory=list)
    warning: str | None = None  # the task_started mark that could not be recorded


def start(
    jobs: RayJobs,
    run: Run,
    chunk: Chunk,
    decided: submission.JobDecision,
    at: Try,
    *,
    latest: int | None,
    began: float,
    size: Callable[[], WorldOption | None] | None = None,
) -> Started:
    """Act on the job's decision: submit this try's job (a drill in the DAG run's conf armed in it), admit and
    take over the job that went on warm into this chunk, or follow an earlier try's job (adopted) or this try's
    own (re-attached). The try's start is marked first (`began`: when the task began; the goodput ledger's
    scheduling gap ends there). size: an elastic run's world size for a submitted job (relay.ops.elastic.size)."""
    sub_id = decided.submission_id
    warning = mark(run, "task_started", chunk, sub_id, at=began, dag_run=at.dag_run, try_number=at.number)
    if decided.action == "submit":
        env = drill(run, at.conf, at.dag_run)
        done = submit(jobs, run, chunk, sub_id, dag_run=at.dag_run, try_number=at.number, env=env, size=size)
        how = f"resumes from step {latest or 0}; submitted Ray job {sub_id} (lease token {done.request.lease_token})"
        if done.request.world_size is not None:
            how += f" at world size {done.request.world_size}"
        return Started(how, True, list(done.stopped), warning)
    if decided.action == "warm":
        admit_warm(run, chunk, sub_id, by=at.by())
        how = f"admitted and took over Ray job {sub_id}, which starts this chunk warm ({decided.why})"
        return Started(how, True, warning=warning)
    if decided.action == "adopt":
        how = f"this try adopts Ray job {sub_id} of an earlier try instead of stopping it ({decided.why})"
    else:
        how = (
            f"re-attaching to Ray job {sub_id} ({decided.state and decided.state.status}) instead of submitting a second one"
        )
    return Started(how, False, warning=warning)


def admit_warm(run: Run, chunk: Chunk, attempt: str, *, by: str) -> None:
    """Admit the job that went on warm into this chunk and take over its lease token (relay.runs.handoff)."""
    token = run.folder.lease().current() or {}
    handoff.admit(run.dir, chunk.index, attempt=attempt, token=int(token.get("token") or 0), by=by)


def submit(
    jobs: RayJobs,
    run: Run,
    chunk: Chunk,
    sub_id: str,
    *,
    dag_run: str,
    try_number: int,
    env: dict[str, str],
    size: Callable[[], WorldOption | None] | None = None,
) -> submission.Submitted:
    """Stop the run's other jobs (one that holds the lease gets its grace to save the step it is in), then submit
    this try's under the run's lease; with warm chunks the next chunk's train task admits and takes it over."""
    done = submission.submit_chunk(
        jobs,
        run,
        chunk.end_step,
        sub_id,
        chunk=chunk.index,
        env=env,
        metadata=lambda req: job_metadata(req, dag_run, try_number),
        stop_others_wait_s=run.spec.ray.stop_grace_seconds + STOP_MARGIN_S,
        handoff=True,
        size=size,
    )
    mark(run, "job_submitted", chunk, sub_id)
    fault_point(f"after_submit:{run}", chunk.index)  # the fault suite's worker kill lands here
    return done


def drill(run: Run, conf: Mapping[str, Any] | None, dag_run: str) -> dict[str, str]:
    """A crash drill asked for in the DAG run's conf (`relay_fault`, the demo's provoked resume): armed in every
    job of the DAG run until it fired once, so that it fires in whichever job trains its step (a job that went
    on warm from an earlier chunk too) and the retry that resumes is not killed again."""
    wanted = (conf or {}).get("relay_fault")
    if not wanted:
        return {}
    digest = hashlib.sha256(dag_run.encode()).hexdigest()[:8]
    which = hashlib.sha256(repr(wanted).encode()).hexdigest()[:8]
    return drill_env(wanted, relay_dir(run.dir, "drills", f"{digest}-{which}.fired"))


def mark(run: Run, phase: str, chunk: Chunk, attempt: str, **fields: Any) -> str | None:
    """A phase mark in events.jsonl for the goodput ledger (relay.runs.phases); one that cannot be written (a
    DAG run of an earlier incarnation is fenced out) is returned as a warning, never raised."""
    try:
        record_phase(run.folder, phase, chunk=chunk.index, attempt=attempt, **fields)
    except (OSError, LeaseLost) as e:
        return f"run {run}: the {phase} mark of {attempt} was not recorded ({e})"
    return None


def mark_job_times(run: Run, chunk: Chunk, jobs: RayJobs, sub_id: str) -> str | None:
    """The job's start and end as Ray recorded them (the ledger's submission, start-up and teardown)."""
    try:
        state = jobs.get(sub_id)
        if state is not None and state.metadata.get("relay_chunk") != str(chunk.index):
            # A job that went on warm into this chunk started for an earlier one: its start is that chunk's.
            state = replace(state, start_time=None)
        record_job_times(run.dir, state, chunk=chunk.index)
    except (OSError, RelayError) as e:
        return f"run {run}: the times of Ray job {sub_id} were not recorded ({e})"
    return None


@dataclass(frozen=True)
class Watch:
    """What the job's trigger follows (relay.airflow.triggers.RayJobTrigger's arguments less the address and the
    submission id), and how long Airflow waits for the trigger before it fails the try."""

    trigger: dict[str, Any]
    timeout_s: float

    def describe(self) -> str:
        """The stall limits, in a log's words."""
        return (
            f"a step-less stretch of {self.trigger['stall_after_s']:.0f}s (plus {self.trigger['startup_s']:.0f}s "
            "before the first step and after the last) is a stall: alerted, job stopped, retried"
        )


def watch(run: Run, chunk: Chunk, *, started: float) -> Watch:
    """The trigger enforces the chunk's deadline itself (it stops the job); Airflow's own timeout, a little later,
    only fires when no triggerer ran it: the try fails, the job trains on, and the next try adopts it."""
    spec = run.spec
    deadline = started + spec.ray.chunk_timeout_minutes * 60
    stop_grace = spec.ray.stop_grace_seconds + STOP_MARGIN_S
    trigger = {
        "deadline": deadline,
        "poll_seconds": spec.ray.poll_seconds,
        "stall_after_s": stall_limit_s(run),
        "startup_s": spec.alerts.startup_minutes * 60,
        "end_step": chunk.end_step,
        "adoptable": True,
        "stop_grace_s": stop_grace,
        "run_dir": str(run.dir),
        "handoff_chunk": chunk.index + 1 if spec.warm_chunks and chunk.index < chunk.count else None,
    }
    timeout = max(0.0, deadline - time.time()) + stop_grace + 2 * spec.ray.poll_seconds + TRIGGER_TIMEOUT_MARGIN_S
    return Watch(trigger, timeout)


def latest(run: Run) -> tuple[int | None, str | None]:
    """The run's latest valid checkpoint (None for a fresh run), or None and what is wrong with the tracker's: the
    chunk's trainer then quarantines it and falls back."""
    return latest_step_or_problem(run.dir)


def resume_step(run: Run) -> int | None:
    """The step a new job of the run resumes from (None: a fresh run); a broken tracker is a CheckpointError."""
    return latest_valid_step(run.dir)


@dataclass
class Ahead:
    """A chunk's job that went on warm into the next chunk: whether that chunk's train task already answered (admitted
    or refused it), the admission limit, and how the job's follower (relay.airflow.triggers.WarmJobTrigger) follows it
    (the chunk, the step it went on from, until when it waits for the answer, the train task's stall limits)."""

    submission: str  # the job's
    answer: dict | None
    limit_s: float
    watch: follow_job.WarmWatch


def ahead(run: Run, chunk: Chunk, submission: str) -> Ahead | None:
    """Whether job `submission` of `chunk` went on warm into the next chunk (None: nothing trains ahead), and how to
    follow it until that chunk's train task admits it (chunks.admission_timeout_minutes; by default twice the chunk's
    own duration, at least 5 minutes)."""
    spec, nxt = run.spec, chunk.index + 1
    record = handoff.warm(run.dir, nxt)
    if record is None or record.get("attempt") != submission:
        return None
    limit = handoff.admission_limit_s(spec.chunks.admission_timeout_minutes, record.get("chunk_seconds"))
    watch = follow_job.WarmWatch(
        run_dir=str(run.dir),
        chunk=nxt,
        deadline=(epoch(record.get("time")) or time.time()) + limit,
        poll_seconds=spec.ray.poll_seconds,
        stop_grace_s=spec.ray.stop_grace_seconds + STOP_MARGIN_S,
        # A stall while training ahead is a stall as in the train task: alerted, the job stopped.
        stall_after_s=stall_limit_s(run),
        startup_s=spec.alerts.startup_minutes * 60,
        from_step=record.get("from_step"),
    )
    return Ahead(submission, handoff.answer(run.dir, nxt, submission), limit, watch)


@dataclass(frozen=True)
class FallenBack:
    """The job's trainer quarantined checkpoints (or set a tracker aside) and resumed from an older step."""

    step: int
    what: str
    action: str


def fallbacks(run: Run, attempt: str) -> list[FallenBack]:
    """The fallbacks of an attempt at its resume, from its chunk_start events: people should know."""
    out = []
    for e in read_events(run.dir):
        if e["event"] != "chunk_start" or e.get("attempt") != attempt:
            continue
        step, bad = e["resumed_from"], e.get("quarantined")
        if bad:
            what = f"checkpoint(s) at step {', '.join(map(str, bad))} failed validation"
            action = f"quarantined them (never loaded, never published) and resumed from step {step}" + (
                f", restored from its published copy {e['restored_from']}"
                if e.get("restored_from")
                else "; the steps after it were trained again"
            )
        elif e.get("tracker_refused"):
            what = f"the tracker was refused ({'; '.join(e['tracker_refused'])})"
            action = f"set the tracker aside and resumed from the newest valid checkpoint, step {step}"
        else:
            continue
        out.append(FallenBack(step, what, action))
    return out


@dataclass(frozen=True)
class Notice:
    """An alert a step asks the front-end to send (relay.alerts' kinds), with its fields."""

    kind: str
    what: str
    fields: dict[str, Any]


def notices(
    run: Run,
    chunk: Chunk,
    event: Mapping[str, Any],
    at: Try,
    *,
    status: str,
    tail: Callable[[], str],
) -> list[Notice]:
    """What people hear when a chunk's job ends, whatever it did: each fallback at its resume, and a stall (the
    trigger stopped the job)."""
    sub_id = event["submission_id"]
    out = [
        Notice(
            "fallback",
            f"{chunk}: {fb.what} at resume; resumed from step {fb.step}",
            {
                "chunk": chunk.index,
                "step": fb.step,
                "quarantined_to": str(relay_dir(run.dir, QUARANTINE)),
                "action": fb.action,
                "scope": sub_id,
            },
        )
        for fb in fallbacks(run, sub_id)
    ]
    if status == follow_job.STALLED:  # the trigger stopped a job that made no step
        then = chunk_policy.after_stall(latest_valid_step(run.dir), try_number=at.number, max_tries=at.max_tries)
        fields = {
            "chunk": chunk.index,
            "step": event.get("step"),
            "details": tail(),
            "action": f"stopped Ray job {sub_id}; {then}",
        }
        out.append(Notice("stall", f"{chunk}: {event.get('message', '')}", fields))
    return out


@dataclass(frozen=True)
class Failure:
    """A failed job: its cause, the decision, and the message the try fails with."""

    cause: failure_cause.Cause
    decision: chunk_policy.FailureDecision
    message: str


def failure(
    jobs: RayJobs,
    run: Run,
    chunk: Chunk,
    event: Mapping[str, Any],
    at: Try,
    *,
    status: str,
    tail: str,
) -> Failure:
    """Classify the failed job's cause (a killed worker on any node: whether that node's OOM killer acted while
    the job ran), record it (events.jsonl: chunk_failed) and decide what the try does (chunk_policy.on_failure)."""
    spec, sub_id = run.spec, event["submission_id"]
    step = failure_cause.step_of_failure(run.dir, sub_id) or event.get("step")
    message = event.get("message", "")
    oom_nodes = (
        node_oom.evidence_since_start(run.dir, sub_id, jobs, spec)
        if failure_cause.could_be_oom_kill(message, tail, event.get("exit_code"))
        else []
    )

    def classified(lost: list[str] | None) -> failure_cause.Cause:
        return failure_cause.classify(
            status,
            message,
            tail,
            event.get("exit_code"),
            step=step,
            oom_kills=failure_cause.oom_kills_since_start(run.dir, sub_id),
            oom_nodes=oom_nodes,
            lost_nodes=lost,
        )

    suspect = classified(None).cause  # a lost peer's collective error comes before the head declares its node dead
    cause = classified(elastic.lost_nodes(jobs.address, run, sub_id, settle_s=elastic.death_settle_s(run, suspect)))
    decision = chunk_policy.on_failure(
        cause,
        failure_cause.earlier_failures(run.dir, chunk.index, at.dag_run),
        retry_on=spec.airflow.retry_on,
        backoff_s=spec.airflow.retry_backoff_seconds,
        try_number=at.number,
        max_tries=at.max_tries,
    )
    failure_cause.record_failure(
        run.folder,
        cause,
        chunk=chunk.index,
        attempt=sub_id,
        dag_run=at.dag_run,
        try_number=at.number,
        policy=decision.policy,
    )
    text = (
        f"{chunk} of run {run}: Ray job {sub_id} ended {status}; {cause.describe()}\n{cause.report()}\n"
        f"{decision.why}\n--- last lines of the job's log ---\n{tail}"
    )
    return Failure(cause, decision, text)
