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

import dataclasses
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from relay.airflow.assets import run_checkpoints
from relay.airflow.decisions import DecisionNeeded, Rejected, answer, ask, skip_rejected
from relay.airflow.hooks import RayJobsHook, checkpoint_store
from relay.airflow.links import RAY_JOB_XCOM, CheckpointLink, RayJobLink, RunReportLink, ray_job_page
from relay.airflow.notifiers import (
    notify,
    notify_deadline,
    notify_divergence,
    notify_error,
    notify_recovery,
    notify_resharded,
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
    CapacityTrigger,
    CheckpointTrigger,
    RayJobTrigger,
    WarmJobTrigger,
)
from relay.common.faultpoint import fault_point
from relay.ops import chunk_policy, elastic, publish_chunk, runs, train_chunk, validate_chunk
from relay.ops.runs import Chunk, ChunkPlan, Run

JOB_STATE_KEY = "relay_ray_job"  # the chunk's submission id, in the task's state store (kept across tries)


class ChunkFailed(AirflowException):
    """A chunk's job failed; Airflow retries the task. `cause`: its classification (relay.ops.chunk_policy.Cause),
    which the failure alert names."""

    def __init__(self, message: str, cause: chunk_policy.Cause | None = None):  # one positional arg: picklable
        super().__init__(message)
        self.cause = cause


class ChunkFailedForGood(AirflowFailException):
    """A chunk's job failed for a cause whose policy is to stop (or the same exception at the same step
    twice): Airflow does not retry it."""

    def __init__(self, message: str, cause: chunk_policy.Cause | None = None):  # one positional arg: picklable
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

    @staticmethod
    def _try(context) -> train_chunk.Try:
        ti, dag_run = context["ti"], context["dag_run"]
        return train_chunk.Try(dag_run.run_id, ti.try_number, ti.max_tries, ti.task_id, dag_run.conf)

    if TYPE_CHECKING:
        # BaseOperator.defer, as the task SDK declares it (mypy takes airflow as Any): it raises TaskDeferred,
        # so an execute() that ends by deferring returns nothing.
        def defer(
            self, *, trigger: Any, method_name: str, kwargs: dict[str, Any] | None = None, timeout: Any = None
        ) -> NoReturn: ...


class RayChunkOperator(ChunkTaskOperator):
    """A chunk's train task: the steps are relay.ops.train_chunk's, the decisions relay.ops.chunk_policy's; this
    class adds Airflow's part (the task's state store, the Ray job link, deferral, alerts, failing the try)."""

    ui_color = "#e8f0fe"
    operator_extra_links = (RayJobLink(), RunReportLink())

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._submission_id: str | None = None

    def execute(self, context) -> dict:
        began = time.time()  # the try runs: the scheduling gap before it ends here (relay.insights.goodput)
        run, chunk = self._context(context)
        latest, problem = train_chunk.latest(run)
        self._warn(problem and f"run {run}: {problem}; the chunk's trainer quarantines it and falls back")
        if chunk.done_by(latest):
            return self._done(context, run, chunk, f"already reached step {latest}; nothing to train")
        self._before_job(context, run, chunk, latest)
        hook, at, store = RayJobsHook(run.spec.ray.conn_id), self._try(context), context.get("task_state_store")
        remembered = store.get(JOB_STATE_KEY) if store is not None else None
        job = train_chunk.job(hook.jobs, run, chunk, at, remembered=remembered, warn=self.log.warning)
        if job.action == "succeeded":
            return self._done(context, run, chunk, f"job {job.submission_id} had already succeeded")
        started = time.time()  # an adopted job's chunk timeout counts again from here
        self._submission_id, page = job.submission_id, ray_job_page(hook.dashboard_url, job.submission_id)
        try:
            went = train_chunk.start(
                hook.jobs, run, chunk, job, at, latest=latest, began=began, size=lambda: self._size(context, run, chunk)
            )
        except elastic.WaitForNodes as wait:
            self._wait_for_nodes(context, run, chunk, wait, hook.address)
        self._warn(went.warning)
        if went.stopped:
            self.log.warning("stopped live jobs of run %s before submitting (one writer per run): %s", run, went.stopped)
        if store is not None and went.remember:
            store.set(JOB_STATE_KEY, job.submission_id)  # Airflow keeps it across tries (ResumableJobMixin's store)
        self.log.info("%s of run %s: %s: %s", chunk, run, went.how, page)
        context["ti"].xcom_push(key=RAY_JOB_XCOM, value={"submission_id": job.submission_id, "url": page})
        watch = train_chunk.watch(run, chunk, started=started)
        self.log.info("%s", watch.describe())
        trigger = RayJobTrigger(address=hook.address, submission_id=job.submission_id, **watch.trigger)
        self.defer(trigger=trigger, method_name="execute_complete", timeout=timedelta(seconds=watch.timeout_s))

    def _size(self, context, run: Run, chunk: Chunk) -> elastic.WorldOption | None:
        """An elastic run's world size for the job about to be submitted (relay.ops.elastic.size), its checkpoint
        resharded to it: a change is alerted (and the reshard, as a spec's change of size is)."""
        hook = RayJobsHook(run.spec.ray.conn_id)
        sized = elastic.size(run, hook.address, checkpoint_store(run.spec), chunk=chunk.index, publish_or_fail=True)
        if sized is None:
            return None
        self.log.info("%s of run %s trains at world size %s: %s", chunk, run, sized.world_size, sized.why)
        if sized.resharded is not None:
            self.log.info("%s", sized.resharded.done)
            notify_resharded(context, run, sized.resharded.result)
        if sized.changed:
            notify(
                context,
                run,
                "world_size",
                f"{chunk}: world size {sized.previous} -> {sized.world_size}",
                chunk=chunk.index,
                details=sized.why,
                action=f"training goes on at world size {sized.world_size} from the resharded checkpoint",
                scope=f"{chunk.index}|{sized.previous}|{sized.world_size}",
            )
        return sized.option

    def _wait_for_nodes(self, context, run: Run, chunk: Chunk, wait: elastic.WaitForNodes, address: str) -> NoReturn:
        """The chunk waits for the cluster's nodes, deferred (no worker slot held); below the minimum, alerted once."""
        self.log.warning("%s", wait)
        if wait.below_minimum:
            notify(context, run, "capacity", f"{chunk}: {wait.what}", chunk=chunk.index, action=wait.fix or "")
        trigger = CapacityTrigger(address, wait.groups, wait.until, run.spec.elastic.poll_seconds)
        self.defer(trigger=trigger, method_name="capacity_returned")

    def capacity_returned(self, context, event: dict | None = None) -> dict:
        """The wait for nodes is over (the cluster holds them, or elastic.wait_for_nodes_minutes passed): go on."""
        self.log.info("%s", (event or {}).get("message", ""))
        return self.execute(context)

    def _before_job(self, context, run: Run, chunk: Chunk, latest: int | None) -> None:
        """The resume preview in the log, the chunk's checks (data, settings), the run's deadline, and a person's
        word where the resume would fall back below quarantined checkpoints."""
        self.log.info("%s", train_chunk.resume_preview(run, chunk, latest))
        drift = context["params"].get("allow_drift") or []
        checked = train_chunk.check(run, chunk, allow_drift=drift, dag_run=context["dag_run"].run_id)
        if checked.error is not None:
            if checked.warm_refused:
                self.log.warning(
                    "Ray job %s went on warm into %s: refused, it stops without committing", checked.warm_refused, chunk
                )
            action = f"{chunk} not started (no retries); the run's checkpoints are untouched."
            notify_error(context, run, checked.error, chunk=chunk.index, action=action)
            raise AirflowFailException(f"{chunk} of run {run} not started: {checked.error}")
        for change in checked.source_changes:
            self.log.warning("training continues on the frozen copy (data.on_source_change: use_frozen):\n%s", change)
            notify_use_frozen(context, run, change)
        self._deadline(context, run, train_chunk.eta_now(run, latest))
        if (fallback := train_chunk.fallback(run, latest)) is not None:
            ask(context, DecisionNeeded(run, fallback.decision()), method_name="fallback_decided")

    def _deadline(self, context, run: Run, found) -> None:
        """Alert once when the run's ETA is past alerts.deadline (relay.insights.eta); it never fails the task."""
        if isinstance(found, str):
            self.log.warning("run %s: %s", run, found)
        elif found is not None:
            self.log.info("run %s: %s", run, found.describe())
            if chunk_policy.deadline_missed(found):
                notify_deadline(context, run, found)

    def _done(self, context, run: Run, chunk, how: str) -> dict:
        try:
            done = train_chunk.finish(run, chunk, how)
        except train_chunk.NotReached as e:
            raise AirflowException(str(e)) from None
        self.log.info("%s of run %s: done (%s); latest checkpoint step %s", chunk, run, how, done.latest)
        self._deadline(context, run, done.eta)
        if done.replay.compared:
            self.log.info("%s", done.replay.summary())
        notify_divergence(context, run, done.replay)
        notify_recovery(
            context, run, f"{chunk} of run {run} is done: step {done.latest}", chunk=chunk.index, step=done.latest
        )
        return done.result

    def _warn(self, warning: str | None) -> None:
        if warning:
            self.log.warning("%s", warning)

    def fallback_decided(self, context, event: dict | None = None, decision: dict | None = None) -> dict:
        """A person answered the fallback question: record the approval (events.jsonl), then run the chunk."""
        run, chunk = self._context(context)
        try:
            got = answer(run, decision or {}, event or {})
        except Rejected as rejected:
            skip_rejected(self.log, rejected)
        train_chunk.approve_fallback(run, chunk, got)
        self.log.warning("%s of run %s: %s approved resuming from step %s", chunk, run, got.by, got.data["resume_from"])
        return self.execute(context)

    def execute_complete(self, context, event: dict) -> dict:
        run, chunk = self._context(context)
        status, sub_id = event_status(event, f"{chunk} of run {run}", "submission_id"), event["submission_id"]
        self._warn(train_chunk.mark_job_times(run, chunk, RayJobsHook(run.spec.ray.conn_id).jobs, sub_id))
        try:
            tail = lambda: job_log_tail(run.spec, event)  # noqa: E731  (only a stall's alert reads it)
            for n in train_chunk.notices(run, chunk, event, self._try(context), status=status, tail=tail):
                notify(context, run, n.kind, n.what, **n.fields)
            if status == HANDED_OFF:
                return self._done(context, run, chunk, event.get("message") or "handed off warm")
            if status != "SUCCEEDED":
                self._failed(context, run, chunk, event, status)
            return self._done(context, run, chunk, f"job {sub_id} succeeded")
        finally:  # a success, a failure, or a backoff's wait (deferred): this try's part ends here
            self._warn(train_chunk.mark(run, "task_done", chunk, sub_id))

    def _failed(self, context, run: Run, chunk, event: dict, status: str) -> NoReturn:
        """Fail the try as the failure's decision says: retry, retry after a backoff (deferred: no worker slot
        held), or no retry."""
        jobs, tail = RayJobsHook(run.spec.ray.conn_id).jobs, job_log_tail(run.spec, event)
        failed = train_chunk.failure(jobs, run, chunk, event, self._try(context), status=status, tail=tail)
        self.log.error("%s", failed.message)
        if failed.decision.action == "stop":
            raise ChunkFailedForGood(failed.message, failed.cause)
        if failed.decision.action == "backoff":
            from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger

            self.log.warning(
                "waiting %.0fs before failing this try, so that its retry starts later", failed.decision.backoff_s
            )
            kwargs = {"message": failed.message, "cause": failed.cause.to_event()}
            self.defer(
                trigger=TimeDeltaTrigger(timedelta(seconds=failed.decision.backoff_s)),
                method_name="backoff_complete",
                kwargs=kwargs,
            )
        raise ChunkFailed(failed.message, failed.cause)

    def backoff_complete(self, context, event: Any = None, message: str = "", cause: dict | None = None) -> NoReturn:
        """The backoff of a failed try is over: fail it, so that Airflow retries now."""
        raise ChunkFailed(message, chunk_policy.cause_of(cause))

    def on_kill(self) -> None:
        """The task was killed while in execute(): stop its job (a deferred task is the trigger's on_kill)."""
        if self._submission_id:
            spec = runs.spec_at(self.spec_path)
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
        nxt = chunk.index + 1
        job = context["ti"].xcom_pull(task_ids=self.train_task, key=RAY_JOB_XCOM) or {}
        sub_id = job.get("submission_id")
        warm = train_chunk.ahead(run, chunk, sub_id) if sub_id else None
        if warm is None:
            raise AirflowSkipException(f"{chunk}'s job {sub_id} did not go on warm into chunk {nxt}: nothing trains ahead")
        if getattr(context["dag_run"], "triggering_user_name", None) == "dag_test":
            # `airflow dags test` runs one task at a time, its triggers in line: nothing would admit the job while this
            # task waited for it. The next chunk's train task admits it as usual.
            raise AirflowSkipException(f"`airflow dags test`: the job training chunk {nxt} ahead is not followed")
        if (got := warm.answer) is not None:
            return {"submission_id": sub_id, "admitted": bool(got.get("admitted")), "why": got.get("why")}
        context["ti"].xcom_push(key=RAY_JOB_XCOM, value=job)
        self.log.info(
            "Ray job %s went on warm into chunk %s at step %s; followed until that chunk's train task admits it (at "
            "most %.1f min): marking this task or the DAG run failed stops it without committing",
            sub_id,
            nxt,
            warm.watch.from_step,
            warm.limit_s / 60,
        )
        self.defer(
            trigger=WarmJobTrigger(
                address=RayJobsHook(run.spec.ray.conn_id).address,
                submission_id=warm.submission,
                watched=self.watched,
                **dataclasses.asdict(warm.watch),
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
            latest = train_chunk.resume_step(run)
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
    The steps are relay.ops.validate_chunk's.
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
        fault_point(f"validate:{run}", chunk.index)  # the fault suite's worker kill lands here
        trained = (context["ti"].xcom_pull(task_ids=self.train_task) or {}) if self.train_task else {}
        if validate_chunk.admitted_before(run, chunk, trained.get("how", "")):
            self.log.info("%s of run %s was done and admitted before this try", chunk, run)
            return {"ok": True, "step": chunk.end_step, "already": True}
        if validate_chunk.reached(run, chunk):
            return self._validate(context, run, chunk)
        self.defer(
            trigger=CheckpointTrigger(
                str(run.dir), chunk.end_step, deadline=time.time() + run.spec.ray.chunk_timeout_minutes * 60
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
        status = event_status(event, f"{chunk} of run {run}", "submission_id")
        if status != "SUCCEEDED":
            raise AirflowException(
                f"{chunk} of run {run}: validation job {event['submission_id']} ended "
                f"{status}: {event.get('message', '')}\n{job_log_tail(run.spec, event)}"
            )
        try:
            found = validate_chunk.admission_of_job(RayJobsHook(run.spec.ray.conn_id).jobs, event["submission_id"])
        except validate_chunk.NoVerdict as e:
            raise AirflowException(str(e)) from None
        return self._admitted(context, run, chunk, found)

    def _validate(self, context, run: Run, chunk) -> dict:
        expected = self._expected_step(chunk)
        if run.spec.checkpoints.validate_on != "ray":
            return self._admitted(context, run, chunk, validate_chunk.admit_here(run, chunk, expected_step=expected))
        hook = RayJobsHook(run.spec.ray.conn_id)
        sub_id = validate_chunk.start_on_ray(hook.jobs, run, chunk, self._try(context), expected_step=expected)
        self.defer(
            trigger=RayJobTrigger(
                address=hook.address,
                submission_id=sub_id,
                deadline=time.time() + run.spec.ray.chunk_timeout_minutes * 60,
                poll_seconds=run.spec.ray.poll_seconds,
            ),
            method_name="ray_validation_complete",
        )

    def _admitted(self, context, run: Run, chunk, admission: dict) -> dict:
        found = validate_chunk.verdict(chunk, admission)
        if found.ok:
            self.log.info("%s of run %s: checkpoint valid:\n%s", chunk, run, found.report)
            step = chunk.end_step
            notify_recovery(
                context, run, f"{chunk} of run {run}: checkpoint step {step} is valid", chunk=chunk.index, step=step
            )
            return admission
        notify(
            context,
            run,
            "checkpoint_invalid",
            f"checkpoint step {chunk.end_step} failed the {found.check} check: {found.detail}",
            chunk=chunk.index,
            step=chunk.end_step,
            details=f"check report of step {chunk.end_step}:\n{found.report}",
            quarantined_to=found.quarantined_to,
            action=found.action,
        )
        raise AirflowFailException(
            f"{chunk} of run {run}: checkpoint step {chunk.end_step} INVALID: {found.failed}; quarantined to "
            f"{found.quarantined_to} (never published); the tracker now names step "
            f"{admission['fell_back_to'] or 'none'}. Clear this chunk's train task to train it again from there."
        )


class PublishCheckpointOperator(ChunkTaskOperator):
    """Publish a chunk's validated checkpoint to S3 (files, manifest, then latest), export a Hugging
    Face model for milestones and the final step, apply retention, and emit the checkpoint asset event
    (relay.ops.publish_chunk)."""

    ui_color = "#fef7e0"
    operator_extra_links = (CheckpointLink(), RunReportLink())

    def execute(self, context) -> dict:
        run, chunk = self._context(context)
        store = checkpoint_store(run.spec)
        done = publish_chunk.publish(run, chunk, store)
        if done.how == "skipped":  # trained past this chunk's end without saving there: a later chunk publishes
            self.log.warning("%s of run %s: %s", chunk, run, done.describe())
            self._announce(context, run, {"run": run.name, "step": chunk.end_step, "skipped": True})
        else:
            self.log.info("%s of run %s: %s", chunk, run, done.describe())
        if done.how == "published":
            pub = done.publication
            assert pub is not None
            extra = {"run": run.name, "step": chunk.end_step, "uri": pub.uri, "manifest": pub.manifest_uri}
            extra |= {"hf_model": pub.hf_uri, "spec": run.spec.name, "dag_run": context["dag_run"].run_id}
            self._announce(context, run, extra)
        publish_report(run, store, context)
        if done.how == "published":
            what = f"{chunk} of run {run}: step {chunk.end_step} is published"
            notify_recovery(context, run, what, chunk=chunk.index, step=chunk.end_step)
        return done.result

    def _announce(self, context, run: Run, extra: dict) -> None:
        """The asset event of this publication, on the run's own asset, through the spec's alias."""
        for alias in self.outlets:
            context["outlet_events"][alias].add(run_checkpoints(run), extra=extra)
