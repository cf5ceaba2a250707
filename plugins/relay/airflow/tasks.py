"""Callables of a run DAG's plain Python tasks: preflight (first, cheap, before any GPU time) and finish."""

from __future__ import annotations

import logging
from datetime import datetime

from airflow.sdk.exceptions import AirflowFailException

from relay.airflow.decisions import Answer, DecisionNeeded
from relay.airflow.hooks import RayJobsHook, checkpoint_store
from relay.airflow.links import report_page
from relay.airflow.notifiers import (
    Channels,
    notify_error,
    notify_finished,
    notify_recovery,
    notify_resharded,
    notify_use_frozen,
)
from relay.airflow.task_ids import RUN_TASK
from relay.common.errors import RelayError
from relay.ops import preflight_run, publish_chunk, reshard_run, run_history, runs, train_run
from relay.ops.runs import Run

log = logging.getLogger(__name__)


def training_run(spec_path: str, context, run_from_task: str = RUN_TASK) -> Run:
    """This DAG run's training run, as preflight.run resolved it: the spec's data paths dated with the DAG
    run's logical date, the run's name, and the incarnation it found or began."""
    resolved = context["ti"].xcom_pull(task_ids=run_from_task)
    when = datetime.fromisoformat(resolved["logical_date"]) if resolved.get("logical_date") else None
    return runs.run_named(spec_path, resolved["run_name"], resolved.get("incarnation"), when)


def logical_date(context):
    """The DAG run's logical date; a manual trigger in Airflow 3 may have none: then when it was run."""
    dr = context["dag_run"]
    return getattr(dr, "logical_date", None) or dr.run_after


def _who(context) -> str:
    dr = context["dag_run"]
    return getattr(dr, "triggering_user_name", None) or str(getattr(dr, "run_type", "") or "unknown")


def settings_guard(spec_path: str, answer: dict | None = None, **context) -> list[str]:
    """Refuse a chunk whose resume-critical settings drifted, unless allow_drift names them (recorded); with
    airflow.approvals, ask a person instead (the diff), and go on with the keys they approved (`answer`)."""
    run = training_run(spec_path, context)
    allow, by = list(context["params"].get("allow_drift") or []), _who(context)
    if answer:
        allow, by = allow + answer["data"]["keys"], Answer(**answer).who()
    try:
        checked = preflight_run.guard_settings(
            run,
            allow=allow,
            by=by,
            dag_run=context["dag_run"].run_id,
            store=lambda: checkpoint_store(run.spec),
            ask=run.spec.airflow.approvals and not answer,
        )
    except RelayError as e:
        notify_error(context, run, e, action="no chunk started; the run's checkpoints are untouched.")
        raise AirflowFailException(str(e)) from None
    if checked.question is not None:
        raise DecisionNeeded(run, checked.question)
    allowed = checked.allowed
    if allowed:
        log.warning("run %s: drift allowed by allow_drift and recorded: %s", run, "; ".join(allowed))
    else:
        log.info("run %s: resume-critical settings match the run's recorded ones", run)
    notify_recovery(context, run, f"run {run}: its settings pass the guard again")
    return allowed


def data_freeze(spec_path: str, **context) -> dict:
    """First chunk: check the data's quality, freeze it, record the settings. Later: guard the sources."""
    run = training_run(spec_path, context)
    try:
        state = preflight_run.freeze_data(run, checkpoint_store(run.spec), _who(context))
    except RelayError as e:
        notify_error(context, run, e, action="no chunk started; nothing was frozen or changed.")
        raise AirflowFailException(str(e)) from None
    for summary in state.quality:
        log.info("%s", summary)
    for change in state.source_changes:
        log.warning("data.on_source_change is use_frozen: training continues on the frozen copy.\n%s", change)
        notify_use_frozen(context, run, change)
    log.info(
        "run %s trains on frozen data: %s",
        run,
        ", ".join(f"{f['role']} {f['sha256'][:12]} ({f['rows']} rows, from {f['source']})" for f in state.frozen),
    )
    notify_recovery(context, run, f"run {run}: its data passes its checks again")
    return {"froze_now": state.froze_now, "frozen": state.frozen, "source_changes": state.source_changes}


def reshard_to_spec(spec_path: str, **context) -> dict | None:
    """checkpoints.on_world_size_change: reshard. Before the chunk's job: when the spec's world size differs from the
    latest checkpoint's, reshard that step in place (the original kept), validate it, publish it, alert once."""
    run = training_run(spec_path, context)
    try:  # S3's copy of the step is the resharded one from now on, as the local one is
        done = reshard_run.reshard_to_spec(run, checkpoint_store(run.spec), publish_or_fail=True)
    except RelayError as e:
        notify_error(context, run, e, action="the chunk was not started; the run's checkpoints are kept.")
        raise AirflowFailException(str(e)) from None
    if done is None:
        log.info("run %s: the latest checkpoint is at the spec's world size; nothing to reshard", run)
        return None
    log.warning("%s", done.done)
    notify_resharded(context, run, done.result)
    return done.result.to_dict()


def preflight(spec_path: str, answer: dict | None = None, **context) -> dict:
    """Validate the spec with its data and checkpoint dir, resolve the training run, guard a fresh start.

    A RelayError fails the task without retries: retrying a bad spec or an unconfirmed fresh start
    cannot help, and no chunk starts. With airflow.approvals, an unconfirmed fresh start of a run that has
    checkpoints asks a person instead (what would be archived), and goes on once approved (`answer`).
    """
    params = context["params"]
    when = logical_date(context)
    started_by = f"{context['dag_run'].run_id}"
    try:
        # A scheduled spec: each logical date is a training run of its own, in its own folder.
        run = runs.run_to_start(spec_path, params.get("run"), when)
        spec, store = run.spec, checkpoint_store(run.spec)
        confirm = params.get("confirm_fresh_start") or ""
        asked_by = f"DAG run {context['dag_run'].dag_id}/{context['dag_run'].run_id}"
        if answer:  # a person approved the fresh start in the UI
            confirm, started_by = run.name, f"{started_by} (fresh start approved by {Answer(**answer).who()})"
        elif (
            params.get("fresh_start")
            and confirm.strip() != run.name
            and spec.airflow.approvals
            and (question := preflight_run.fresh_start_question(run, store, asked_by)) is not None
        ):
            raise DecisionNeeded(run, question)
        state = train_run.prepare(
            spec,
            run.name,
            fresh_start=bool(params.get("fresh_start")),
            confirm=confirm,
            started_by=started_by,
            store=store,
            asked_by=asked_by,
            jobs=_ray_jobs(spec) if params.get("fresh_start") else None,
        )
    except DecisionNeeded:
        raise
    except RelayError as e:
        raise AirflowFailException(str(e)) from None
    for note in state.notes:
        log.warning("%s", note)
    if state.problem:
        log.warning(
            "run %s: %s; the next chunk's trainer quarantines it and resumes from the newest valid checkpoint",
            state.run_name,
            state.problem,
        )
    if state.archived_to or state.archived_uri:
        log.warning(
            "fresh start of run %s (new incarnation %s): the old run was moved aside to %s, never deleted",
            state.run_name,
            state.incarnation,
            " and ".join(x for x in (state.archived_to, state.archived_uri) if x),
        )
    channels = Channels.of(spec, params)
    log.info(
        "run %s (%s, incarnation %s): latest valid checkpoint step %s of %s; alerts go to %s",
        state.run_name,
        state.run_dir,
        state.incarnation,
        state.latest_step,
        spec.total_steps,
        ", ".join(
            f"{name} {', '.join(channels.emails)}" if name.startswith("email") else name for name, _ in channels.senders()
        )
        or "nobody (no alert channel configured)",
    )
    log.info("chunk plan:\n%s", preflight_run.chunk_plan(spec, state.latest_step))
    _log_checklist(state.run(spec))
    return {
        **state.to_dict(),
        "alert_emails": list(channels.emails),
        "logical_date": when.isoformat(),
        "data_files": list(spec.data.train_files),
    }


def _ray_jobs(spec):
    """The spec's Ray cluster, where a fresh start looks for the run's live jobs; None (said) without one."""
    try:
        return RayJobsHook(spec.ray.conn_id).jobs
    except Exception as e:  # noqa: BLE001 - a missing connection: the lease still fences out any writer of the old run
        log.warning("cannot look for live Ray jobs of the run through connection %s: %s", spec.ray.conn_id, e)
        return None


def _log_checklist(run: Run) -> None:
    """`python -m relay doctor`'s checklist, by the same code (cheap checkpoint level): what the next
    tasks enforce (settings, data), and what the chunks handle themselves (fallback, live jobs).
    Informational here: a check that cannot run is logged, never fails the task."""
    spec = run.spec
    try:
        findings = preflight_run.checklist(run, checkpoint_store(spec), RayJobsHook(spec.ray.conn_id).jobs)
    except Exception as e:  # noqa: BLE001 - a missing connection, say: the chunk's own submit says so, with what to do
        log.warning("resume checklist not run: %s", e)
        return
    log.info(
        "resume checklist (as `python -m relay doctor %s --run %s`):\n%s",
        spec.source,
        run,
        "\n".join(findings),
    )


def finish(spec_path: str, **context) -> dict:
    """Report where the run's checkpoints and metrics are."""
    run = training_run(spec_path, context)
    spec = run.spec
    done = run_history.finished(run)
    state = done.state
    log.info(
        "run %s complete: step %s/%s; checkpoints in %s; metrics in %s/metrics.jsonl; %d resumes",
        run,
        state.latest_step,
        spec.total_steps,
        state.run_dir,
        state.run_dir,
        done.resumes,
    )
    log.info("run %s %s", run, done.goodput)
    what = f"run {run} finished: step {state.latest_step} of {spec.total_steps}"
    notify_finished(context, run, what, details=done.goodput, step=state.latest_step)
    publish_report(run, checkpoint_store(spec), context)
    return state.to_dict()


def publish_report(run: Run, store, context) -> None:
    """The run report (plots, chunk table, fingerprints) beside the run, and beside its checkpoints in S3
    with a store; the task log names its page in the UI. A report that cannot be made never fails the
    task that asked for it."""

    try:
        out = run_history.publish_report(run, store)
    except Exception as e:  # noqa: BLE001
        log.warning("run report of %s not written: %s", run, e)
        return
    log.info(
        "run report: %s (kept at %s)\n%s",
        report_page(context["dag_run"].dag_id, run.name),
        out.get("html_uri", out["html"]),
        out["summary"],
    )


def evaluate_published(spec_path: str, **context) -> list[dict]:
    """Example evaluation stub, scheduled on a spec's checkpoint asset: load each published checkpoint's
    model (through the safe loader) and report its step. Triggered by hand, conf {"manifest": URI} works too."""

    store = checkpoint_store(runs.spec_at(spec_path))
    events = [
        e.extra
        for events in (context.get("triggering_asset_events") or {}).values()
        for e in events
        if e.extra.get("manifest")
    ]  # a chunk with nothing to publish announces no checkpoint
    if conf_manifest := (context["dag_run"].conf or {}).get("manifest"):
        events.append({"manifest": conf_manifest})
    results = []
    for extra in events:
        found = publish_chunk.evaluate(store, extra["manifest"])
        log.info(
            "evaluated run %s step %s: model shard 0 holds %d parameters (%d tensors)",
            found["run"],
            found["step"],
            found["parameters_in_shard_0"],
            found.pop("tensors"),
        )
        results.append(found)
    if not results:
        log.warning("no checkpoint to evaluate: no triggering asset event and no conf manifest")
    return results
