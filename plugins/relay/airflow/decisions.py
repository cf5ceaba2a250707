"""Decisions only a person should make, asked in Airflow's UI (the standard provider's human-in-the-loop).

Three things Relay will not decide alone (spec `airflow.approvals`, default on):
- a fresh start of a run that has checkpoints, unconfirmed in the trigger (preflight.run): what would be
  archived, local and published;
- a resume-critical settings change (preflight.settings): the diff, key by key, as `relay doctor` prints it;
- a fallback past a quarantined checkpoint that loses more than `approvals.max_steps_lost` steps (a chunk's
  train task): resume from step K, or stop the run.

The task that meets one raises `DecisionNeeded`; `DecidingPythonOperator` (and the train operator) then write
Airflow's HITL detail (subject, the facts, the options: what the Required Actions page shows) and park the
task in awaiting_input (TaskAwaitingInput: no worker slot, no trigger, no triggerer), with one alert that
links to the page. The page, or `PATCH /api/v2/dags/D/dagRuns/R/taskInstances/T/-1/hitlDetails` with
`{"chosen_options": [...]}`, answers it; the task resumes in `decided` with the choice, who made it and
when, and runs again with the answer. A rejection is a person's decision, not a failure: the task says in a
short message who rejected what and that nothing changed, and ends skipped, with every task after it; Relay's
API-server plugin writes the same on the DAG run's note. No answer within `approvals.timeout_minutes` (the
scheduler's timeout sweep) fails the task without retries and stops the DAG run: nothing was changed.

A trigger that already carries the decision (`confirm_fresh_start` naming the run, `allow_drift` naming the
keys) asks nothing, so backfills and CLI triggers stay unattended.
"""

from __future__ import annotations

import textwrap
from datetime import timedelta
from typing import Any, NoReturn
from urllib.parse import quote

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk.exceptions import AirflowFailException

from relay.airflow.notifiers import notify
from relay.common.errors import RelayError
from relay.ops import runs
from relay.ops.approvals import Answer, Decision
from relay.ops.runs import Run


class DecisionNeeded(RelayError):
    """A task met a decision only a person should make (raised by Relay's task code, caught by its operator)."""

    retry_helps = False

    def __init__(self, run: Run, decision: Decision):
        super().__init__(f"run {run}: {decision.subject}", "answer it in the Airflow UI's Required Actions")
        self.run = run
        self.decision = decision


def required_actions_page(context) -> str:
    """The Required Actions page of the asking task, as Airflow's own HITL links build it."""
    from airflow.configuration import conf

    ti = context["ti"]
    base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    return (
        f"{base}/dags/{quote(ti.dag_id)}/runs/{quote(ti.run_id)}/tasks/{quote(ti.task_id)}/required_actions"
        f"?map_index={getattr(ti, 'map_index', -1)}"
    )


def ask(context, need: DecisionNeeded, method_name: str = "decided") -> NoReturn:
    """Write the HITL detail, alert once with its link, and park the task until a person answers."""
    from airflow.sdk.exceptions import TaskAwaitingInput
    from airflow.sdk.execution_time.hitl import upsert_hitl_detail

    run, decision = need.run, need.decision
    upsert_hitl_detail(
        ti_id=context["task_instance"].id,
        options=decision.options,
        subject=decision.subject,
        body=decision.body,
        defaults=None,
        multiple=False,
        params={},
    )
    minutes = run.spec.approvals.timeout_minutes
    page = required_actions_page(context)
    notify(
        context,
        run,
        "decision",
        decision.subject,
        details=decision.body,
        scope=decision.kind,
        action=f"nothing changes until a person answers: {page} (Required Actions); with no answer in "
        f"{minutes:g} minutes this DAG run stops and nothing is lost",
    )
    raise TaskAwaitingInput(
        method_name=method_name, kwargs={"decision": decision.to_dict()}, timeout=timedelta(minutes=minutes)
    )


def answer(run: Run, decision: dict, event: dict) -> Answer:
    """The person's answer to `decision`; a rejection or a timeout stops the DAG run (no retries)."""
    d = Decision(**decision)
    if "error" in event:
        minutes = run.spec.approvals.timeout_minutes
        raise AirflowFailException(
            f'run {run}: nobody answered "{d.subject}" within {minutes:g} minutes (approvals.timeout_minutes): '
            f"this DAG run stops; nothing was changed. Trigger again to be asked again" + _unattended(d.kind, run)
        )
    chosen = (event.get("chosen_options") or [""])[0]
    who = event.get("responded_by_user") or {}
    at = event.get("responded_at")
    when = at.isoformat(timespec="seconds") if at is not None and hasattr(at, "isoformat") else str(at)
    a = Answer(d.kind, chosen, who.get("name") or who.get("id") or "someone", when, d.data)
    if chosen not in d.proceed:
        raise Rejected(rejection_text(run.name, d.subject, chosen, a.who()) + _unattended(d.kind, run) + ".")
    return a


class Rejected(Exception):
    """A person chose an option that does not go on: their decision, said in plain words."""


def rejection_text(run: str, subject: str, chosen: str, who: str) -> str:
    """Who rejected what, and that nothing changed: the task's log and the DAG run's note say the same."""
    return (
        f'"{subject}": {chosen!r} chosen by {who}. Nothing was changed: run {run} stays as it was, and the '
        f"tasks after this one are skipped"
    )


def skip_rejected(log, rejected: Rejected) -> NoReturn:
    """End the asking task as a person decided: a short wrapped message, no traceback, this task and the ones
    after it skipped (the DAG run is not a failure)."""
    from airflow.sdk.exceptions import AirflowSkipException

    log.warning("%s", textwrap.fill(str(rejected), 100))
    raise AirflowSkipException(str(rejected).partition(".")[0])


def _unattended(kind: str, run: Run) -> str:
    """How the same decision is made without asking (a backfill, the CLI)."""
    return {
        "fresh_start": f" (or trigger with fresh_start and confirm_fresh_start {run.name!r}: nothing is asked)",
        "drift": " (or trigger with allow_drift naming the keys: nothing is asked)",
    }.get(kind, "")


class DecidingPythonOperator(PythonOperator):
    """A PythonOperator whose callable may raise DecisionNeeded: the task asks (`ask`) and, once answered,
    runs its callable again with `answer` (an Answer's dict) among its keyword arguments."""

    def execute(self, context) -> Any:
        try:
            return super().execute(context)
        except DecisionNeeded as need:
            ask(context, need)

    def decided(self, context, event: dict | None = None, decision: dict | None = None) -> Any:
        decision = decision or {}
        kwargs: dict[str, Any] = dict(self.op_kwargs)  # type: ignore[has-type]  # PythonOperator sets it
        try:
            got = answer(runs.run_named(kwargs["spec_path"], decision.get("data", {}).get("run")), decision, event or {})
        except Rejected as rejected:
            skip_rejected(self.log, rejected)
        self.op_kwargs = {**kwargs, "answer": got.to_dict()}
        try:
            return super().execute(context)
        except DecisionNeeded as again:  # the answer did not settle it (the run changed meanwhile): ask again
            ask(context, again)
