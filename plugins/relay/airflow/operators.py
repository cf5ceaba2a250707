"""The chunk's operators: train (one Ray job), validate (the gate), publish (S3). All deferrable or short.

RayChunkOperator: one chunk of a run as one Ray job; deferrable while the job trains.

execute():
  1. The chunk is done when the run's latest valid checkpoint has reached its end step: finish at
     once, with success (a skip would cascade to the later chunks).
  2. The checks before a chunk (settings, data, the deadline, a fallback a person must approve).
  3. Take over the job that went on warm into this chunk (admit it: relay.runs.handoff), re-attach to this
     try's job, adopt a healthy job of an earlier try, or stop the run's other jobs and submit a new one under
     the run's lease (relay.jobs.submission, which `relay train` shares); defer.
execute_complete(): succeed only when the job succeeded, or committed the chunk's end step and went on warm into
the next chunk (HANDED_OFF), and the run's checkpoint reached the end step.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from relay.airflow.assets import run_checkpoints
from relay.airflow.decisions import Decision, DecisionNeeded, Rejected, answer, ask, skip_rejected
from relay.airflow.hooks import RayJobsHook, checkpoint_store
from relay.airflow.links import RAY_JOB_XCOM, CheckpointLink, RayJobLink, RunReportLink, ray_job_page
from relay.airflow.notifiers import (
    notify,
    notify_deadline,
    notify_divergence,
    notify_error,
    notify_recovery,
    notify_use_frozen,
)
from relay.airflow.task_ids import RUN_TASK
from relay.airflow.tasks import publish_report, training_run
from relay.airflow.triggers import (
    ADMITTED,
    ENDED,
    HANDED_OFF,
    REFUSED,
    STALLED,
    CheckpointTrigger,
    RayJobTrigger,
    WarmJobTrigger,
)
from relay.alerts import stall_limit_s
from relay.checkpoints import manifest
from relay.checkpoints.preview import inspect_dir
from relay.checkpoints.resume import QUARANTINE, quarantined
from relay.checkpoints.validate import latest_step_or_problem, latest_valid_step
from relay.common.errors import LeaseLost, RelayError
from relay.common.faultpoint import drill_env, fault_point
from relay.common.timestamps import epoch
from relay.insights.audit import audit
from relay.insights.eta import eta
from relay.jobs import submission
from relay.jobs.ray_jobs import LOG_TAIL_LINES, STOP_MARGIN_S, job_metadata, submission_id
from relay.preflight import admission
from relay.preflight.admission import admit, parse_job_output
from relay.preflight.checks import before_chunk
from relay.runs import failure_cause, handoff, layout, node_oom
from relay.runs.layout import checkpoint_reached, relay_dir, step_dir
from relay.runs.metrics import read_events
from relay.runs.phases import record_job_times, record_phase
from relay.runs.run import Run
from relay.s3.publication import publish_checkpoint
from relay.spec.plan import Chunk, ChunkPlan
from relay.spec.run_spec import deadline_seconds, load_spec

FALLBACK_APPROVED = "fallback_approved"  # events.jsonl: a person approved resuming below a quarantined step
JOB_STATE_KEY = "relay_ray_job"  # the chunk's submission id, in the task's state store (kept across tries)
TRIGGER_TIMEOUT_MARGIN_S = 10.0  # Airflow's defer timeout comes this long after the trigger's own deadline handling


class ChunkFailed(AirflowException):
    """A chunk's job failed; Airflow retries the task. `cause`: its classification (relay.runs.failure_cause),
    which the failure alert names."""

    def __init__(self, message: str, cause: failure_cause.Cause | None = None):  # one positional arg: picklable
        super().__init__(message)
        self.cause = cause


class ChunkFailedForGood(AirflowFailException):
    """A chunk's job failed for a cause whose policy is to stop (or the same exception at the same step
    twice): Airflow does not retry it."""

    def __init__(self, message: str, cause: failure_cause.Cause | None = None):  # one positional arg: picklable
        super().__init__(message)
        self.cause = cause


def job_log_tail(spec, event: dict) -> str:
    """The last lines of the log of the job a trigger event is about (events do not carry them)."""
    return RayJobsHook(spec.ray.conn_id).jobs.log_tail(event["submission_id"])


def event_status(event, what: str, *keys: str) -> str:
    """The status of a trigger's event, which must also carry `keys`. An event without them (one a trigger
    of another Relay version fired, say) is an error that says so, not a KeyError."""
    if not isinstance(event, dict) or not isinstance(event.get("status"), str) or any(k not in event for k in keys):
        raise AirflowException(
            f"{what}: the trigger's event {str(event)[:200]!r} has no status"
            + (f" or no {', '.join(keys)}" if keys else "")
            + "; clear the task to run it again"
        )
    return event["status"]


class ChunkTaskOperator(BaseOperator):
    """What a chunk's train, validate and publish tasks share: the spec file, the chunk's index and the task
    whose XCom names the training run; (run, chunk) are rebuilt from them at each call."""

    def __init__(self, *, spec_path: str, chunk_index: int, run_from_task: str = RUN_TASK, **kwargs):
        super().__init__(**kwargs)
        self.spec_path = spec_path
        self.chunk_index = chunk_index
        self.run_from_task = run_from_task

    def _run(self, context) -> Run:
        return training_run(self.spec_path, context, self.run_from_task)

    def _context(self, context) -> tuple[Run, Chunk]:
        run = self._run(context)
        return run, ChunkPlan.from_spec(run.spec).chunk(self.chunk_index)

    if TYPE_CHECKING:
        # BaseOperator.defer, as the task SDK declares it (mypy takes airflow as Any): it raises TaskDeferred,
        # so an execute() that ends by deferring returns nothing.
        def defer(
            self, *, trigger: Any, method_name: str, kwargs: dict[str, Any] | None = None, timeout: Any = None
        ) -> NoReturn: ...


class RayChunkOperator(ChunkTaskOperator):
    ui_color = "#e8f0fe"
    operator_extra_links = (RayJobLink(), RunReportLink())

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._submission_id: str | None = None

    # ---------------------------------------------------------------------------- helpers

    def _done(self, context, run: Run, chunk, how: str) -> dict:
        latest = latest_valid_step(run.dir)
        if not chunk.done_by(latest):
            raise AirflowException(
                f"{chunk} of run {run}: the job ended but the latest valid checkpoint is step {latest}, not "
                f"{chunk.end_step}. The retry resumes from step {latest or 0}."
            )
        self.log.info("%s of run %s: done (%s); latest checkpoint step %s", chunk, run, how, latest)
        self._check_deadline(context, run, latest)
        replay = audit(run.dir, run.spec.audit.tolerance)  # the steps this run trained twice, against their first try
        if replay.compared:
            self.log.info("%s", replay.summary())
        notify_divergence(context, run, replay)
        notify_recovery(context, run, f"{chunk} of run {run} is done: step {latest}", chunk=chunk.index, step=latest)
        return {"run_name": run.name, "chunk": chunk.index, "end_step": chunk.end_step, "latest_step": latest, "how": how}

    def _check_deadline(self, context, run: Run, latest: int | None) -> None:
        """Alert once when the run's ETA is past alerts.deadline (relay.insights.eta); it never fails the task."""
        spec = run.spec
        if not spec.alerts.deadline:
            return
        try:
            deadline = deadline_seconds(spec.alerts.deadline, spec.source, "alerts.deadline")
            found = eta(
                run.dir,
                total_steps=spec.total_steps,
                chunk_steps=spec.chunk_steps,
                latest_step=latest or 0,
                deadline=deadline,
            )
        except RelayError as e:
            self.log.warning("run %s: no ETA against alerts.deadline: %s", run, e)
            return
        if found is None or deadline is None:
            return
        self.log.info("run %s: %s", run, found.describe())
        if (found.late_s or 0) > 0:
            notify_deadline(context, run, found)

    def _checks_before_chunk(self, context, run: Run, chunk) -> None:
        """Settings drift and changed sources are caught before the chunk's job starts, every chunk."""
        try:
            checked = before_chunk(
                run, allow_drift=context["params"].get("allow_drift") or [], dag_run=context["dag_run"].run_id
            )
        except RelayError as e:
            if (warm := handoff.refuse(run.dir, chunk.index, e.what)) is not None:
                self.log.warning("Ray job %s went on warm into %s: refused, it stops without committing", warm, chunk)
            notify_error(
                context,
                run,
                e,
                chunk=chunk.index,
                action=f"{chunk} not started (no retries); the run's checkpoints are untouched.",
            )
            raise AirflowFailException(f"{chunk} of run {run} not started: {e}") from None
        for change in checked["source_changes"]:
            self.log.warning("training continues on the frozen copy (data.on_source_change: use_frozen):\n%s", change)
            notify_use_frozen(context, run, change)

    def _log_resume_preview(self, run: Run, chunk, latest: int | None) -> None:
        """What the job will load, as `python -m relay checkpoint inspect` shows it (small files only)."""
        if not latest:
            self.log.info("%s of run %s starts at step 0: no checkpoint to resume from", chunk, run)
            return
        try:
            self.log.info("%s of run %s %s", chunk, run, inspect_dir(run.dir, latest, verify=False).one_line())
        except RelayError as e:  # the trainer validates again, quarantines and falls back
            self.log.warning("%s of run %s: no resume preview: %s", chunk, run, e.what)

    # ---------------------------------------------------------------------------- execute
    def _mark(self, run: Run, phase: str, chunk, attempt: str, **fields) -> None:
        """A phase mark in events.jsonl for the goodput ledger (relay.runs.phases): one that cannot be written is
        logged, never fails the task."""
        try:  # fenced: a DAG run of an earlier incarnation marks nothing in the new one
            record_phase(run.folder, phase, chunk=chunk.index, attempt=attempt, **fields)
        except (OSError, LeaseLost) as e:
            self.log.warning("run %s: the %s mark of %s was not recorded (%s)", run, phase, attempt, e)

    def _mark_job_times(self, run: Run, chunk, hook, sub_id: str) -> None:
        """The job's start and end as Ray recorded them (the ledger's submission, start-up and teardown)."""
        try:
            job = hook.jobs.get(sub_id)
            if job is not None and job.metadata.get("relay_chunk") != str(chunk.index):
                # A job that went on warm into this chunk started for an earlier one: its start is that chunk's.
                job = replace(job, start_time=None)
            record_job_times(run.dir, job, chunk=chunk.index)
        except (OSError, RelayError) as e:
            self.log.warning("run %s: the times of Ray job %s were not recorded (%s)", run, sub_id, e)

    def execute(self, context) -> dict:
        began = time.time()  # the try runs: the scheduling gap before it ends here (relay.insights.goodput)
        run, chunk = self._context(context)
        latest, problem = latest_step_or_problem(run.dir)
        if problem:
            self.log.warning(
                "run %s: %s; the chunk's trainer quarantines it and falls back to the newest valid checkpoint", run, problem
            )
        if chunk.done_by(latest):
            return self._done(context, run, chunk, f"already reached step {latest}; nothing to train")
        self._before_job(context, run, chunk, latest)
        hook = RayJobsHook(run.spec.ray.conn_id)
        job = self._job_of_this_try(context, hook, run, chunk)
        if job.action == "succeeded":
            return self._done(context, run, chunk, f"job {job.submission_id} had already succeeded")
        if job.action == "ended":
            assert job.state is not None
            raise AirflowException(
                f"Ray job {job.submission_id} of this try already ended {job.state.status}: "
                f"{job.state.message}. The next try resumes from the latest checkpoint."
            )
        started = time.time()  # an adopted job's chunk timeout counts again from here
        dag_run, try_number = context["dag_run"].run_id, context["ti"].try_number
        self._mark(run, "task_started", chunk, job.submission_id, at=began, dag_run=dag_run, try_number=try_number)
        self._submission_id = job.submission_id
        if job.action == "submit":
            self._submit(context, hook, run, chunk, job.submission_id, latest)
        else:
            self._take_over(context, hook, run, chunk, job)
        self._defer_on_job(context, hook, run, chunk, job.submission_id, started)

    def _before_job(self, context, run: Run, chunk: Chunk, latest: int | None) -> None:
        """What the chunk must pass before a job trains it: the resume preview in the log, the chunk's checks (data,
        settings, approvals), the run's deadline, and a person's word where the resume would fall back."""
        self._log_resume_preview(run, chunk, latest)
        self._checks_before_chunk(context, run, chunk)
        self._check_deadline(context, run, latest)
        try:
            self._fallback_to_approve(run, latest)
        except DecisionNeeded as need:
            ask(context, need, method_name="fallback_decided")

    def _take_over(self, context, hook: RayJobsHook, run: Run, chunk: Chunk, job: submission.JobDecision) -> None:
        """This try follows a job it did not submit: a warm job going on into this chunk (admitted here, its lease
        token taken over), an earlier try's job (adopted), or this try's own (re-attached)."""
        page = ray_job_page(hook.dashboard_url, job.submission_id)
        if job.action == "warm":
            token = run.folder.lease().current() or {}
            handoff.admit(
                run.dir,
                chunk.index,
                attempt=job.submission_id,
                token=int(token.get("token") or 0),
                by=f"{context['ti'].task_id} try {context['ti'].try_number} of DAG run {context['dag_run'].run_id}",
            )
            if (state_store := context.get("task_state_store")) is not None:
                state_store.set(JOB_STATE_KEY, job.submission_id)
            self.log.info(
                "%s of run %s: admitted and took over Ray job %s, which starts this chunk warm (%s): %s",
                chunk,
                run,
                job.submission_id,
                job.why,
                page,
            )
        elif job.action == "adopt":
            self.log.info(
                "%s of run %s: this try adopts Ray job %s of an earlier try instead of stopping it (%s): %s",
                chunk,
                run,
                job.submission_id,
                job.why,
                page,
            )
        else:
            self.log.info(
                "re-attaching to Ray job %s (%s) instead of submitting a second one: %s",
                job.submission_id,
                job.state and job.state.status,
                page,
            )

    def _job_of_this_try(self, context, hook: RayJobsHook, run: Run, chunk: Chunk) -> submission.JobDecision:
        sub_id = submission_id(run.spec.name, run.name, context["dag_run"].run_id, chunk.index, context["ti"].try_number)
        state_store = context.get("task_state_store")
        return submission.decide(
            hook.jobs,
            run,
            chunk,
            sub_id,
            stall_limit_s=stall_limit_s(run),
            warn=self.log.warning,
            remembered=state_store.get(JOB_STATE_KEY) if state_store is not None else None,
        )

    def _submit(self, context, hook: RayJobsHook, run: Run, chunk: Chunk, sub_id: str, latest: int | None) -> None:
        """Stop the run's other jobs (one that still holds the lease gets its grace to save the step it is in:
        relay.trainers.stopping), then submit this try's under the run's lease."""
        ti, dag_run_id = context["ti"], context["dag_run"].run_id
        done = submission.submit_chunk(
            hook.jobs,
            run,
            chunk.end_step,
            sub_id,
            chunk=chunk.index,
            env=self._drill_env(context, run, chunk),
            metadata=lambda req: job_metadata(req, dag_run_id, ti.try_number),
            stop_others_wait_s=run.spec.ray.stop_grace_seconds + STOP_MARGIN_S,
            handoff=True,  # with warm chunks, the next chunk's train task admits and takes over the job
        )
        if done.stopped:
            self.log.warning("stopped live jobs of run %s before submitting (one writer per run): %s", run, done.stopped)
        self._mark(run, "job_submitted", chunk, sub_id)
        fault_point(f"after_submit:{run}", chunk.index)  # the fault suite's worker kill lands here
        if (state_store := context.get("task_state_store")) is not None:
            state_store.set(JOB_STATE_KEY, sub_id)  # Airflow keeps it across tries (ResumableJobMixin's store)
        self.log.info(
            "%s of run %s: resumes from step %s; submitted Ray job %s (lease token %s): %s",
            chunk,
            run,
            latest or 0,
            sub_id,
            done.request.lease_token,
            ray_job_page(hook.dashboard_url, sub_id),
        )

    def _defer_on_job(self, context, hook: RayJobsHook, run: Run, chunk: Chunk, sub_id: str, started: float) -> NoReturn:
        """Give the task its "Ray job" link (RayJobLink, shown while deferred) and wait on the job in the triggerer."""
        spec = run.spec
        context["ti"].xcom_push(
            key=RAY_JOB_XCOM, value={"submission_id": sub_id, "url": ray_job_page(hook.dashboard_url, sub_id)}
        )
        deadline = started + spec.ray.chunk_timeout_minutes * 60
        stall_after = stall_limit_s(run)
        self.log.info(
            "a step-less stretch of %.0fs (plus %.0fs before the first step and after the last) is a "
            "stall: alerted, job stopped, retried",
            stall_after,
            spec.alerts.startup_minutes * 60,
        )
        stop_grace = spec.ray.stop_grace_seconds + STOP_MARGIN_S
        self.defer(
            trigger=RayJobTrigger(
                address=hook.address,
                submission_id=sub_id,
                deadline=deadline,
                poll_seconds=spec.ray.poll_seconds,
                stall_after_s=stall_after,
                startup_s=spec.alerts.startup_minutes * 60,
                end_step=chunk.end_step,
                adoptable=True,
                stop_grace_s=stop_grace,
                run_dir=str(run.dir),
                handoff_chunk=chunk.index + 1 if spec.warm_chunks and chunk.index < chunk.count else None,
            ),
            method_name="execute_complete",
            # The trigger enforces the deadline itself (it stops the job); Airflow's own timeout, a little later,
            # only fires when no triggerer ran it: this try fails, the job trains on, and the next try adopts it.
            timeout=timedelta(
                seconds=max(0.0, deadline - time.time()) + stop_grace + 2 * spec.ray.poll_seconds + TRIGGER_TIMEOUT_MARGIN_S
            ),
        )

    @staticmethod
    def _fallback_to_approve(run: Run, latest: int | None) -> None:
        """Raise DecisionNeeded when this chunk would resume below a quarantined checkpoint and train more than
        approvals.max_steps_lost steps again, unless a person approved that fallback (or approvals are off)."""
        spec = run.spec
        k = latest or 0
        newer = sorted({q["step"] for q in quarantined(run.dir) if isinstance(q.get("step"), int) and q["step"] > k})
        allowed = spec.approvals.steps_allowed(spec.chunk_steps)
        if not spec.airflow.approvals or not newer or newer[-1] - k <= allowed:
            return
        n = newer[-1]
        if any(
            e.get("event") == FALLBACK_APPROVED and e.get("quarantined") == n and e.get("resume_from") == k
            for e in read_events(run.dir)
        ):
            return
        resume = f"Resume from step {k}"
        raise DecisionNeeded(
            run,
            Decision(
                "fallback",
                f"Resume run {run.name} from step {k}, {n - k} steps back?",
                f"Checkpoint(s) at step(s) {', '.join(map(str, newer))} failed validation and were quarantined (their "
                f"reports: `{relay_dir(run.dir, QUARANTINE)}`). The newest valid checkpoint is step {k}: resuming there "
                f"trains steps {k + 1}..{n} again, {n - k} steps, more than approvals.max_steps_lost ({allowed}).\n\n"
                f"**{resume}** to go on. **Stop the run** to look first: nothing is changed, and the next trigger asks "
                "again.",
                [resume, "Stop the run"],
                [resume],
                {"run": run.name, "quarantined": n, "resume_from": k},
            ),
        )

    def fallback_decided(self, context, event: dict | None = None, decision: dict | None = None) -> dict:
        """A person answered the fallback question: record the approval (events.jsonl), then run the chunk."""
        run, chunk = self._context(context)
        try:
            got = answer(run, decision or {}, event or {})
        except Rejected as rejected:
            skip_rejected(self.log, rejected)
        run.folder.record(
            FALLBACK_APPROVED,
            chunk=chunk.index,
            quarantined=got.data["quarantined"],
            resume_from=got.data["resume_from"],
            by=got.by,
            at=got.at,
        )
        self.log.warning(
            "%s of run %s: %s approved resuming from step %s (quarantined step %s)",
            chunk,
            run,
            got.by,
            got.data["resume_from"],
            got.data["quarantined"],
        )
        return self.execute(context)

    @staticmethod
    def _drill_env(context, run: Run, chunk) -> dict[str, str]:
        """A crash drill asked for in the DAG run's conf (`relay_fault`, the demo's provoked resume): armed in
        every job of the DAG run until it fired once, so that it fires in whichever job trains its step (a job
        that went on warm from an earlier chunk too) and the retry that resumes is not killed again."""
        drill = (context["dag_run"].conf or {}).get("relay_fault")
        if not drill:
            return {}
        dag_run = hashlib.sha256(context["dag_run"].run_id.encode()).hexdigest()[:8]
        which = hashlib.sha256(repr(drill).encode()).hexdigest()[:8]
        return drill_env(drill, relay_dir(run.dir, "drills", f"{dag_run}-{which}.fired"))

    def execute_complete(self, context, event: dict) -> dict:
        run, chunk = self._context(context)
        status = event_status(event, f"{chunk} of run {run}", "submission_id")
        self._mark_job_times(run, chunk, RayJobsHook(run.spec.ray.conn_id), event["submission_id"])
        try:
            return self._complete(context, run, chunk, event, status)
        finally:  # a success, a failure, or a backoff's wait (deferred): this try's part ends here
            self._mark(run, "task_done", chunk, event["submission_id"])

    def _complete(self, context, run: Run, chunk, event: dict, status: str) -> dict:
        spec = run.spec
        self._alert_fallback(context, run, chunk, event["submission_id"])
        if status == STALLED:
            ti = context["ti"]
            latest = latest_valid_step(run.dir)
            then = (
                f"Airflow's retry (try {ti.try_number + 1} of {ti.max_tries + 1}) resumes from step {latest or 0}"
                if ti.try_number <= ti.max_tries
                else f"no retries left: this DAG run stops; clear the task to resume from step {latest or 0}"
            )
            notify(
                context,
                run,
                "stall",
                f"{chunk}: {event.get('message', '')}",
                chunk=chunk.index,
                step=event.get("step"),
                details=job_log_tail(spec, event),
                action=f"stopped Ray job {event['submission_id']}; {then}",
            )
        if status == HANDED_OFF:
            return self._done(context, run, chunk, event.get("message") or "handed off warm")
        if status != "SUCCEEDED":
            self._failed(context, run, chunk, event, status)
        return self._done(context, run, chunk, f"job {event['submission_id']} succeeded")

    def _failed(self, context, run: Run, chunk, event: dict, status: str) -> NoReturn:
        """Classify the failed job's cause, record it (events.jsonl: chunk_failed) and fail the try as its
        policy says: retry, retry after a backoff (deferred: no worker slot held), or no retry."""
        spec, sub_id, ti = run.spec, event["submission_id"], context["ti"]
        tail = job_log_tail(spec, event)
        step = failure_cause.step_of_failure(run.dir, sub_id) or event.get("step")
        oom_nodes = (  # a killed worker on any node: did that node's OOM killer act while the job ran?
            node_oom.evidence_since_start(run.dir, sub_id, RayJobsHook(spec.ray.conn_id).jobs, spec)
            if failure_cause.could_be_oom_kill(event.get("message", ""), tail, event.get("exit_code"))
            else []
        )
        cause = failure_cause.classify(
            status,
            event.get("message", ""),
            tail,
            event.get("exit_code"),
            step=step,
            oom_kills=failure_cause.oom_kills_since_start(run.dir, sub_id),
            oom_nodes=oom_nodes,
        )
        dag_run = context["dag_run"].run_id
        repeated = failure_cause.repeats(cause, failure_cause.earlier_failures(run.dir, chunk.index, dag_run))
        policy = failure_cause.STOP if repeated else failure_cause.policy(cause, spec.airflow.retry_on)
        failure_cause.record_failure(
            run.folder, cause, chunk=chunk.index, attempt=sub_id, dag_run=dag_run, try_number=ti.try_number, policy=policy
        )
        why = (
            "the same exception at the same step as an earlier try: it is deterministic, so Airflow does not retry it"
            if repeated
            else f"policy for {cause.cause}: {policy} (spec airflow.retry_on)"
        )
        message = (
            f"{chunk} of run {run}: Ray job {sub_id} ended {status}; {cause.describe()}\n{cause.report()}\n"
            f"{why}\n--- last lines of the job's log ---\n{tail}"
        )
        self.log.error("%s", message)
        if policy == failure_cause.STOP:
            raise ChunkFailedForGood(message, cause)
        if policy == failure_cause.BACKOFF and ti.try_number <= ti.max_tries and spec.airflow.retry_backoff_seconds:
            from datetime import timedelta

            from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger

            self.log.warning(
                "waiting %.0fs before failing this try, so that its retry starts later (backoff)",
                spec.airflow.retry_backoff_seconds,
            )
            self.defer(
                trigger=TimeDeltaTrigger(timedelta(seconds=spec.airflow.retry_backoff_seconds)),
                method_name="backoff_complete",
                kwargs={"message": message, "cause": cause.to_event()},
            )
        raise ChunkFailed(message, cause)

    def backoff_complete(self, context, event: Any = None, message: str = "", cause: dict | None = None) -> NoReturn:
        """The backoff of a failed try is over: fail it, so that Airflow retries now."""
        raise ChunkFailed(message, failure_cause.Cause(**(cause or {"cause": failure_cause.UNKNOWN})))

    def _alert_fallback(self, context, run: Run, chunk, attempt: str) -> None:
        """The job's trainer quarantined checkpoints and resumed from an older one: people should know."""
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
            notify(
                context,
                run,
                "fallback",
                f"{chunk}: {what} at resume; resumed from step {step}",
                chunk=chunk.index,
                step=step,
                quarantined_to=str(relay_dir(run.dir, QUARANTINE)),
                action=action,
                scope=attempt,
            )

    def on_kill(self) -> None:
        """The task was killed while in execute(): stop its job (a deferred task is the trigger's on_kill)."""
        if self._submission_id:
            spec = load_spec(self.spec_path, check_environment=False)
            RayJobsHook(spec.ray.conn_id).jobs.stop(self._submission_id)


class WarmJobOperator(ChunkTaskOperator):
    """A chunk's `ahead` task: follows the chunk's job once it went on warm into the next chunk, until that chunk's
    train task admits it, so that a job training ahead is never out of Airflow's reach (relay.airflow.triggers.
    WarmJobTrigger): marking this task or its DAG run failed, a failed task in `watched` (the chunk's validation),
    or no admission within the admission limit (chunks.admission_timeout_minutes; by default twice the chunk's own
    duration, at least 5 minutes) refuses the warm chunk, and the job stops at its next step boundary without
    committing anything of it. Skipped when the chunk's job did not go on warm. The grid shows it deferred while the
    job trains ahead; its log says at which step."""

    ui_color = "#fef7e0"
    operator_extra_links = (RayJobLink(), RunReportLink())

    def __init__(self, *, train_task: str, watched: list[str] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.train_task = train_task
        self.watched = list(watched or [])

    def execute(self, context) -> dict:
        run, chunk = self._context(context)
        spec, nxt = run.spec, chunk.index + 1
        job = context["ti"].xcom_pull(task_ids=self.train_task, key=RAY_JOB_XCOM) or {}
        sub_id = job.get("submission_id")
        record = handoff.warm(run.dir, nxt)
        if not sub_id or record is None or record.get("attempt") != sub_id:
            raise AirflowSkipException(f"{chunk}'s job {sub_id} did not go on warm into chunk {nxt}: nothing trains ahead")
        if getattr(context["dag_run"], "triggering_user_name", None) == "dag_test":
            # `airflow dags test` runs one task at a time, its triggers in line: nothing would admit the job while this
            # task waited for it. The next chunk's train task admits it as usual.
            raise AirflowSkipException(f"`airflow dags test`: the job training chunk {nxt} ahead is not followed")
        if (got := handoff.answer(run.dir, nxt, sub_id)) is not None:
            return {"submission_id": sub_id, "admitted": bool(got.get("admitted")), "why": got.get("why")}
        context["ti"].xcom_push(key=RAY_JOB_XCOM, value=job)
        limit = handoff.admission_limit_s(spec.chunks.admission_timeout_minutes, record.get("chunk_seconds"))
        self.log.info(
            "Ray job %s went on warm into chunk %s at step %s; followed until that chunk's train task admits it (at "
            "most %.1f min): marking this task or the DAG run failed stops it without committing",
            sub_id,
            nxt,
            record.get("from_step"),
            limit / 60,
        )
        self.defer(
            trigger=WarmJobTrigger(
                address=RayJobsHook(spec.ray.conn_id).address,
                submission_id=sub_id,
                run_dir=str(run.dir),
                chunk=nxt,
                deadline=(epoch(record.get("time")) or time.time()) + limit,
                poll_seconds=spec.ray.poll_seconds,
                watched=self.watched,
                stop_grace_s=spec.ray.stop_grace_seconds + STOP_MARGIN_S,
                # A stall while training ahead is a stall as in the train task: alerted, the job stopped.
                stall_after_s=stall_limit_s(run),
                startup_s=spec.alerts.startup_minutes * 60,
                from_step=record.get("from_step"),
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context, event: dict) -> dict:
        run, chunk = self._context(context)
        status = event_status(event, f"{chunk} of run {run}", "submission_id")
        sub_id, message = event["submission_id"], event.get("message", "")
        nxt = chunk.index + 1
        if status == ADMITTED or status == ENDED or (status == REFUSED and event.get("by") != "this task"):
            self.log.info("Ray job %s, which trained chunk %s ahead: %s", sub_id, nxt, message)
            return {"submission_id": sub_id, "status": status, "message": message}
        if status == STALLED:
            latest = latest_valid_step(run.dir)
            notify(
                context,
                run,
                "stall",
                f"chunk {nxt}, trained ahead by {chunk}'s job: {message}",
                chunk=nxt,
                step=event.get("step"),
                details=job_log_tail(run.spec, event),
                action=f"refused the warm chunk and stopped Ray job {sub_id}; chunk {nxt}'s train task starts a new "
                f"job from step {latest or 0}",
            )
        raise AirflowException(f"Ray job {sub_id} trained chunk {nxt} of run {run} ahead: {message}")


class ValidateCheckpointOperator(ChunkTaskOperator):
    """Wait for a chunk's checkpoint without holding a worker slot, then pass it through the gate.

    Validation runs where the checkpoint lives: in this worker (spec checkpoints.validate_on: worker)
    or as a Ray job on the cluster (ray). An invalid checkpoint is quarantined, the tracker falls
    back to the newest valid one, and the task fails without retries, naming the check that failed.
    """

    ui_color = "#e6f4ea"
    operator_extra_links = (CheckpointLink(), RunReportLink())
    # The chunk's job ended at its end step, so the tracker names it; a supervised run's one long job
    # trains on past it (relay.airflow.supervised), and only the step's own folder is judged.
    tracker_at_end_step = True

    def _expected_step(self, chunk) -> int | None:
        return chunk.end_step if self.tracker_at_end_step else None

    def __init__(self, *, train_task: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.train_task = train_task

    def execute(self, context) -> dict:
        run, chunk = self._context(context)
        spec = run.spec
        fault_point(f"validate:{run}", chunk.index)  # the fault suite's worker kill lands here
        trained = (context["ti"].xcom_pull(task_ids=self.train_task) or {}) if self.train_task else {}
        here = step_dir(run.dir, chunk.end_step)
        if trained.get("how", "").startswith("already reached") and (not here.is_dir() or manifest.read(here)):
            # Admitted by an earlier gate (and perhaps pruned by retention since). A checkpoint that
            # reached its end step without one (its job was stopped after the commit) is validated now.
            self.log.info("%s of run %s was done and admitted before this try", chunk, run)
            return {"ok": True, "step": chunk.end_step, "already": True}
        if checkpoint_reached(run.dir, chunk.end_step):
            return self._validate(context, run, chunk)
        self.defer(
            trigger=CheckpointTrigger(
                str(run.dir), chunk.end_step, deadline=time.time() + spec.ray.chunk_timeout_minutes * 60
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context, event: dict) -> dict:
        run, chunk = self._context(context)
        if event_status(event, f"{chunk} of run {run}") == "present":
            return self._validate(context, run, chunk)
        raise AirflowException(f"{chunk} of run {run}: {event.get('message', '')}")

    def ray_validation_complete(self, context, event: dict) -> dict:
        """The Ray job that validated the checkpoint on the cluster has ended."""
        run, chunk = self._context(context)
        spec = run.spec
        status = event_status(event, f"{chunk} of run {run}", "submission_id")
        if status != "SUCCEEDED":
            raise AirflowException(
                f"{chunk} of run {run}: validation job {event['submission_id']} ended "
                f"{status}: {event.get('message', '')}\n{job_log_tail(spec, event)}"
            )
        return self._admitted(context, run, chunk, self._ray_admission(spec, event))

    def _validate(self, context, run: Run, chunk) -> dict:
        if run.spec.checkpoints.validate_on == "ray":
            return self._validate_on_ray(context, run, chunk)
        return self._admitted(
            context, run, chunk, admit(run, chunk.end_step, expected_step=self._expected_step(chunk)).to_dict()
        )

    def _validate_on_ray(self, context, run: Run, chunk) -> NoReturn:
        spec = run.spec
        hook = RayJobsHook(spec.ray.conn_id)
        ti = context["ti"]
        sub_id = submission_id(spec.name, run.name, context["dag_run"].run_id, chunk.index, ti.try_number) + "-validate"
        if hook.jobs.get(sub_id) is None:
            request = admission.request_json(run, chunk.end_step, self._expected_step(chunk))
            hook.jobs.submit_module(
                spec,
                "relay.preflight.admission",
                {admission.ENV_VAR: request},
                sub_id,
                {"relay_spec": spec.name, "relay_run": run.name, "relay_role": "validate"},
            )
        self.defer(
            trigger=RayJobTrigger(
                address=hook.address,
                submission_id=sub_id,
                deadline=time.time() + spec.ray.chunk_timeout_minutes * 60,
                poll_seconds=spec.ray.poll_seconds,
            ),
            method_name="ray_validation_complete",
        )

    def _ray_admission(self, spec, event: dict) -> dict:
        logs = RayJobsHook(spec.ray.conn_id).jobs.logs(event["submission_id"])
        admission = parse_job_output(logs)
        if admission is None:
            raise AirflowException(
                f"validation job {event['submission_id']} printed no result:\n"
                + "\n".join(logs.splitlines()[-LOG_TAIL_LINES:])
            )
        return admission

    def _admitted(self, context, run: Run, chunk, admission: dict) -> dict:
        report = "\n".join(f"  {'✔' if c['ok'] else '✘'} {c['name']}: {c['detail']}" for c in admission["checks"])
        if admission["ok"]:
            self.log.info("%s of run %s: checkpoint valid:\n%s", chunk, run, report)
            notify_recovery(
                context,
                run,
                f"{chunk} of run {run}: checkpoint step {chunk.end_step} is valid",
                chunk=chunk.index,
                step=chunk.end_step,
            )
            return admission
        failed = next(c for c in admission["checks"] if not c["ok"])
        notify(
            context,
            run,
            "checkpoint_invalid",
            f"checkpoint step {chunk.end_step} failed the {failed['name']} check: {failed['detail']}",
            chunk=chunk.index,
            step=chunk.end_step,
            details=f"check report of step {chunk.end_step}:\n{report}",
            quarantined_to=admission["quarantined_to"],
            action=f"quarantined it (never published) and pointed the tracker at step "
            f"{admission['fell_back_to'] or 'none'}; this DAG run stops. Clear {chunk.task_group_id}.train "
            "to train the chunk again from there.",
        )
        raise AirflowFailException(
            f"{chunk} of run {run}: checkpoint step {chunk.end_step} INVALID: {failed['name']}: {failed['detail']}; "
            f"quarantined to {admission['quarantined_to']} (never published); the tracker now names step "
            f"{admission['fell_back_to'] or 'none'}. Clear this chunk's train task to train it again from there."
        )


class PublishCheckpointOperator(ChunkTaskOperator):
    """Publish a chunk's validated checkpoint to S3 (files, manifest, then latest), export a Hugging
    Face model for milestones and the final step, apply retention, and emit the checkpoint asset event."""

    ui_color = "#fef7e0"
    operator_extra_links = (CheckpointLink(), RunReportLink())

    def execute(self, context) -> dict:
        run, chunk = self._context(context)
        spec = run.spec
        store = checkpoint_store(spec)
        if self._already_published(run, chunk.end_step, store):
            uri = store.step_uri(run.name, chunk.end_step)
            self.log.info("%s of run %s: already published to %s", chunk, run, uri)
            publish_report(run, store, context)
            return {"step": chunk.end_step, "uri": uri, "already": True}
        if not layout.step_dir(run.dir, chunk.end_step).is_dir():
            # Trained past this chunk's end without saving there (with `relay train`, say): its
            # later chunk's checkpoint is the one to publish.
            self.log.warning(
                "%s of run %s: no checkpoint at step %s and none published; nothing to publish", chunk, run, chunk.end_step
            )
            self._announce(context, run, {"run": run.name, "step": chunk.end_step, "skipped": True})
            publish_report(run, store, context)
            return {"step": chunk.end_step, "skipped": True}
        pub = publish_checkpoint(run, chunk.end_step, store)
        self.log.info(
            "%s of run %s: published %s (%d files uploaded, %d already there, %d bytes in %.1fs)%s",
            chunk,
            run,
            pub.uri,
            pub.uploaded,
            pub.skipped,
            pub.bytes_uploaded,
            pub.seconds,
            f"; Hugging Face model at {pub.hf_uri}" if pub.hf_uri else "",
        )
        if pub.deleted_local or pub.published_retention.get("deleted"):
            self.log.info(
                "retention: deleted local steps %s, published steps %s",
                pub.deleted_local,
                pub.published_retention.get("deleted"),
            )
        self._announce(
            context,
            run,
            {
                "run": run.name,
                "step": chunk.end_step,
                "uri": pub.uri,
                "manifest": pub.manifest_uri,
                "hf_model": pub.hf_uri,
                "spec": spec.name,
                "dag_run": context["dag_run"].run_id,
            },
        )
        publish_report(run, store, context)
        notify_recovery(
            context, run, f"{chunk} of run {run}: step {chunk.end_step} is published", chunk=chunk.index, step=chunk.end_step
        )
        return pub.to_dict()

    def _announce(self, context, run: Run, extra: dict) -> None:
        """The asset event of this publication, on the run's own asset, through the spec's alias."""
        for alias in self.outlets:
            context["outlet_events"][alias].add(run_checkpoints(run), extra=extra)

    @staticmethod
    def _already_published(run: Run, step: int, store) -> bool:
        """Published by an earlier DAG run: S3's manifest is the local one (or the local copy was pruned)."""
        published = store.manifest(run.name, step)
        if published is None:
            return False
        local = manifest.read(layout.step_dir(run.dir, step))
        return local is None or local.files == published.files
