"""A run DAG's preflight tasks, before any GPU time: the question a fresh start asks (the run itself is prepared by
`relay.ops.train_run.prepare`, as `relay train` prepares it), the run's resume-critical settings guarded, its data
checked and frozen, and the resume checklist (`relay doctor`'s, by the same code). Each returns what the task acts
on: a state to push, or the question to ask a person where `airflow.approvals` asks instead of failing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relay.insights import doctor
from relay.ops.approvals import Decision
from relay.preflight.checks import DataState, check_settings, prepare_data, publish_record
from relay.preflight.guard import DriftError
from relay.preflight.prepare import fresh_start_done, fresh_start_plan
from relay.runs.run import Run
from relay.s3.store import CheckpointStore
from relay.spec.plan import ChunkPlan
from relay.spec.run_spec import RunSpec


def fresh_start_question(run: Run, store: CheckpointStore | None, asked_by: str) -> Decision | None:
    """The question a fresh start asks a person under `airflow.approvals` (what it would move aside), or None when
    there is nothing to move aside or `asked_by` (a DAG run) already performed it."""
    if fresh_start_done(run.dir, asked_by):
        return None
    plan = fresh_start_plan(run, store)
    if not plan.needed:
        return None
    return Decision(
        "fresh_start",
        f"Start run {run.name} again from step 0?",
        plan.markdown(run.spec.checkpoint_dir, store.uri if store is not None else None),
        ["Approve", "Reject"],
        ["Approve"],
        {"run": run.name},
    )


def chunk_plan(spec: RunSpec, latest_step: int) -> str:
    """The spec's chunk plan, each chunk marked done or to do against `latest_step`."""
    return ChunkPlan.from_spec(spec).describe(latest_step)


@dataclass
class SettingsCheck:
    """preflight.settings' outcome: the drift allowed (and recorded), or the question to ask about the drift."""

    allowed: list[str] = field(default_factory=list)
    question: Decision | None = None


def guard_settings(
    run: Run, *, allow: list[str], by: str, dag_run: str, store: Callable[[], CheckpointStore | None], ask: bool
) -> SettingsCheck:
    """The run's resume-critical settings against the ones it recorded: a drift not in `allow` raises DriftError,
    or with `ask` becomes a question; an allowed drift is recorded and the run record published again (`store`:
    the run's store, asked for only then)."""
    try:
        allowed = check_settings(run, allow_drift=allow, by=by, dag_run=dag_run)
    except DriftError as e:
        if not ask:
            raise
        return SettingsCheck(question=_drift_question(run, e))
    if allowed:
        publish_record(run, store())
    return SettingsCheck(allowed)


def _drift_question(run: Run, e: DriftError) -> Decision:
    return Decision(
        "drift",
        f"Accept a change of run {run.name}'s resume-critical settings?",
        f"These settings differ from the ones run **{run.name}** recorded:\n\n```\n{e.table}\n```\n\n"
        "Approve to train on with them: the change is recorded (who, when, what), as `allow_drift` records "
        "it. Reject to stop: restore the settings in the spec, or start a new run.",
        ["Approve", "Reject"],
        ["Approve"],
        {"run": run.name, "keys": e.keys},
    )


def freeze_data(run: Run, store: CheckpointStore | None, by: str) -> DataState:
    """preflight.data: at the run's first chunk its data checked and frozen; later its sources guarded."""
    return prepare_data(run, store=store, by=by)


def checklist(run: Run, store: CheckpointStore | None, jobs: Any) -> list[str]:
    """`relay doctor`'s checklist at the cheap checkpoint level, one line per finding."""
    return [f.line() for f in doctor.diagnose(run, store=store, jobs=jobs, deep=False)]
