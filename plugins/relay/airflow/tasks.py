"""Callables of a run DAG's plain Python tasks: preflight (first, cheap, before any GPU time) and finish."""

from __future__ import annotations

import logging

from airflow.sdk.exceptions import AirflowFailException

from relay.errors import RelayError
from relay.metrics import read_events
from relay.plan import ChunkPlan
from relay.runs import prepare_run, run_state
from relay.spec import load_spec

log = logging.getLogger(__name__)


def preflight(spec_path: str, **context) -> dict:
    """Validate the spec with its data and checkpoint dir, resolve the training run, guard a fresh start.

    A RelayError fails the task without retries: retrying a bad spec or an unconfirmed fresh start
    cannot help, and no chunk starts.
    """
    params = context["params"]
    try:
        spec = load_spec(spec_path)
        state = prepare_run(spec, params.get("run"), fresh_start=bool(params.get("fresh_start")),
                            confirm=params.get("confirm_fresh_start") or "",
                            started_by=f"{context['dag_run'].run_id}")
    except RelayError as e:
        raise AirflowFailException(str(e)) from None
    if state.archived_to:
        log.warning("fresh start: the previous folder of run %s was archived to %s", state.run_name,
                    state.archived_to)
    alerts = params.get("alert_emails") or spec.alerts.email
    log.info("run %s (%s): latest valid checkpoint step %s of %s; alerts go to %s", state.run_name, state.run_dir,
             state.latest_step, spec.total_steps, ", ".join(alerts) or "nobody")
    log.info("chunk plan:\n%s", ChunkPlan.from_spec(spec).describe(state.latest_step))
    return {**state.to_dict(), "alert_emails": list(alerts)}


def finish(spec_path: str, **context) -> dict:
    """Report where the run's checkpoints and metrics are."""
    spec = load_spec(spec_path, check_environment=False)
    run = context["ti"].xcom_pull(task_ids="preflight")["run_name"]
    state = run_state(spec, run)
    resumes = [e for e in read_events(spec.run_dir(run)) if e["event"] == "chunk_start" and e["resumed_from"]]
    log.info("run %s complete: step %s/%s; checkpoints in %s; metrics in %s/metrics.jsonl; %d resumes",
             run, state.latest_step, spec.total_steps, state.run_dir, state.run_dir, len(resumes))
    return state.to_dict()
