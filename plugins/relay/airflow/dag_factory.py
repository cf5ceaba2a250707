"""One DAG per run spec in include/runs/:

    preflight.run >> preflight.settings >> preflight.data >> chunk_01.train >> chunk_01.validate
        >> chunk_02.train >> ... >> finish;   chunk_k.validate >> chunk_k.publish >> chunk_k+1.publish;
    with warm chunks, chunk_k.train >> chunk_k.ahead (a leaf: follows the job while it trains chunk k+1 ahead)

Step counts and chunk sizes come from the spec: task groups are fixed when the DAG is parsed.
Params carry only what may change per trigger without changing the DAG's shape or the run's
resume-critical settings: which run, a guarded fresh start, alert overrides, and allow_drift (an
explicit, recorded exception to the settings guard).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG, BaseOperator, Param, TaskGroup

from relay.airflow import form
from relay.airflow.assets import checkpoint_alias
from relay.airflow.decisions import DecidingPythonOperator
from relay.airflow.notifiers import RelayAlertNotifier
from relay.airflow.operators import (
    PublishCheckpointOperator,
    RayChunkOperator,
    ValidateCheckpointOperator,
    WarmJobOperator,
)
from relay.airflow.supervised import is_supervised, supervise_task, validate_task
from relay.airflow.tasks import data_freeze, finish, preflight, reshard_to_spec, settings_guard
from relay.common import project
from relay.common.errors import SpecError
from relay.ops import runs
from relay.ops.runs import ChunkPlan, RunSpec

log = logging.getLogger(__name__)


def params_for(spec: RunSpec) -> dict[str, Param]:
    """The trigger form: every field may be left empty (relay.airflow.form)."""
    return {
        name: Param(field["default"], **{k: v for k, v in field.items() if k != "default"})
        for name, field in form.fields(spec).items()
    }


def build_dag(spec: RunSpec) -> DAG:
    plan = ChunkPlan.from_spec(spec)
    a = spec.airflow
    with DAG(
        deadline=_deadline_alert(spec),
        dag_id=spec.dag_id,
        description=spec.description or f"Relay run spec {spec.name}",
        schedule=a.schedule,
        start_date=datetime.combine(a.start_date, datetime.min.time(), tzinfo=UTC),
        catchup=a.catchup,
        max_active_runs=a.max_active_runs,
        params=params_for(spec),
        default_args={
            "retries": a.retries,
            "retry_delay": timedelta(seconds=a.retry_delay_seconds),
            # one alert per failure event (the ledger de-duplicates); retries alert only on request
            "on_failure_callback": [RelayAlertNotifier(spec.source)],
            "on_retry_callback": [RelayAlertNotifier(spec.source, retry=True)] if spec.alerts.on_retry else [],
        },
        tags=["relay", spec.trainer.kind, *a.tags],
        doc_md=f"**{spec.name}** ({spec.source}): {spec.total_steps} steps in {len(plan.chunks)} chunks of "
        f"{spec.chunk_steps}, trainer `{spec.trainer.kind}`. Each chunk is one Ray job"
        + (f"; pool `{a.pool}` bounds the trainers on the cluster." if a.pool else ".")
        + (f" Scheduled `{a.schedule}`: each DAG run trains run `{spec.name}-<logical date>`." if a.schedule else ""),
    ) as dag:
        kw: dict[str, Any] = {"op_kwargs": {"spec_path": spec.source}, "retries": 0}
        with TaskGroup("preflight", tooltip="before any GPU time: the run, its settings, its data"):
            # Each may ask a person in the UI (relay.airflow.decisions): a fresh start, a settings change.
            run = DecidingPythonOperator(
                task_id="run",
                python_callable=preflight,
                doc_md="Spec, run, fresh-start guard (asks before a fresh start).",
                **kw,
            )
            settings = DecidingPythonOperator(
                task_id="settings",
                python_callable=settings_guard,
                doc_md="Resume-critical settings against the run's recorded ones (asks before accepting a change).",
                **kw,
            )
            data = PythonOperator(
                task_id="data",
                python_callable=data_freeze,
                doc_md="First chunk: data quality, then freeze. Later: the sources against their frozen fingerprints.",
                **kw,
            )
            run >> settings >> data
        upstream: BaseOperator = data
        publish_before = None
        pool = {"pool": a.pool} if a.pool else {}
        # Supervised (verl_ppo): one long job for the run; the chunk tasks only wait for its checkpoints.
        supervisor = supervise_task(spec, **pool) if is_supervised(spec) else None
        if supervisor is not None:
            data >> supervisor
        for chunk in plan.chunks:
            with TaskGroup(chunk.task_group_id, tooltip=str(chunk)):
                if supervisor is not None:
                    validate: BaseOperator = validate_task(spec, chunk)
                    upstream >> validate
                else:
                    train = RayChunkOperator(
                        task_id="train",
                        spec_path=spec.source,
                        chunk_index=chunk.index,
                        **pool,
                        doc_md=f"Train {chunk}: one Ray job that resumes from the latest checkpoint.",
                    )
                    # An invalid checkpoint fails it without retries (AirflowFailException); a lost worker's
                    # try is retried, on any worker.
                    validate = ValidateCheckpointOperator(
                        task_id="validate",
                        spec_path=spec.source,
                        chunk_index=chunk.index,
                        train_task=train.task_id,
                        doc_md=f"Wait for step {chunk.end_step}'s checkpoint; validate it; quarantine it if it is "
                        "not whole.",
                    )
                    if spec.checkpoints.on_world_size_change == "reshard" and not spec.core_settings.world_options:
                        # Its own task, so the UI shows it: a no-op unless the world size changed. (An elastic run's
                        # train task reshards to the size it picks for the job: relay.ops.elastic.)
                        reshard = PythonOperator(
                            task_id="reshard",
                            python_callable=reshard_to_spec,
                            **kw,
                            doc_md="Reshard the latest checkpoint to the spec's world size when "
                            "they differ (the original is kept).",
                        )
                        upstream >> reshard
                        upstream = reshard
                    upstream >> train >> validate
                    if spec.warm_chunks and chunk.index < len(plan.chunks):
                        # A leaf beside validate: follows the job while it trains the next chunk ahead, until that
                        # chunk's train task admits it (or stops it: this task or the DAG run marked failed, a failed
                        # validation, no admission in time).
                        WarmJobOperator(
                            task_id="ahead",
                            spec_path=spec.source,
                            chunk_index=chunk.index,
                            train_task=train.task_id,
                            # Its validation failing, or the next chunk's train task failing or skipped (a
                            # person's rejection): nothing will admit the job.
                            watched=[validate.task_id, f"{plan.chunks[chunk.index].task_group_id}.train"],
                            doc_md=f"Follow {chunk}'s job while it trains the next chunk ahead of its admission.",
                        ).set_upstream(train)
                if spec.s3 is not None:
                    # Chunk k publishes while chunk k+1 trains; publications stay in step order.
                    publish = PublishCheckpointOperator(
                        task_id="publish",
                        spec_path=spec.source,
                        chunk_index=chunk.index,
                        outlets=[checkpoint_alias(spec)],
                        doc_md=f"Publish step {chunk.end_step} to {spec.s3.uri}: files, manifest, then latest.",
                    )
                    validate >> publish
                    if publish_before is not None:
                        publish_before >> publish
                    publish_before = publish
            upstream = validate
        done = PythonOperator(task_id="finish", python_callable=finish, op_kwargs={"spec_path": spec.source})
        upstream >> done
        if supervisor is not None:
            supervisor >> done
        if publish_before is not None:
            publish_before >> done
    return dag


def _deadline_alert(spec: RunSpec):
    """Airflow's deadline alert at alerts.deadline, when it is a fixed time (a ${VAR} is read by the train tasks'
    ETA check only): a DAG run still going then calls notifiers.deadline_missed in the executor."""
    if not spec.alerts.deadline or project.variables(spec.alerts.deadline):
        return None
    from airflow.sdk.definitions.callback import SyncCallback
    from airflow.sdk.definitions.deadline import DeadlineAlert, DeadlineReference

    at = runs.deadline_at(spec)
    if at is None:
        return None
    return DeadlineAlert(
        reference=DeadlineReference.FIXED_DATETIME(at),
        interval=timedelta(0),
        callback=SyncCallback("relay.airflow.notifiers.deadline_missed", kwargs={"spec_path": spec.source}),
    )


def build_dags(runs_dir: Path | None = None) -> dict[str, DAG]:
    """DAGs for every spec in runs_dir (default include/runs).

    A bad spec makes no DAG of its own, so it never breaks the runs of the others; its error shows
    in the UI as the DAG `relay_spec_errors`, whose only task fails with every error.
    """
    runs_dir = runs_dir or project.runs_dir()
    dags: dict[str, DAG] = {}
    errors: list[str] = []
    for path in sorted(runs_dir.glob("*.yaml")):
        try:
            # The environment (data, checkpoint dir) is checked by each run's preflight, not at every parse.
            spec = runs.spec_at(path)
        except SpecError as e:
            log.error("%s", e)
            errors.append(str(e))
            continue
        dags[spec.dag_id] = build_dag(spec)
    if errors:
        dags[ERRORS_DAG_ID] = _errors_dag(errors)
    return dags


ERRORS_DAG_ID = "relay_spec_errors"


def _errors_dag(errors: list[str]) -> DAG:
    text = "\n\n".join(errors)
    with DAG(
        dag_id=ERRORS_DAG_ID,
        schedule=None,
        start_date=datetime(2025, 1, 1),
        catchup=False,
        tags=["relay"],
        description=f"{len(errors)} run spec(s) in include/runs are invalid",
        doc_md="These run specs made no DAG:\n\n" + "\n".join(f"- `{e.splitlines()[0]}`" for e in errors),
    ) as dag:
        PythonOperator(task_id="show_errors", python_callable=_raise, op_kwargs={"text": text}, retries=0)
    return dag


def _raise(text: str) -> None:
    raise SpecError("include/runs", "", "invalid run specs:\n" + text)
