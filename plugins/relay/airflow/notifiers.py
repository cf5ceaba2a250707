"""Alerts delivered through Airflow: the channels (provider hooks), explicit notify calls, and the notifier.

Channels: e-mail through the SMTP provider's SmtpHook, Slack through the Slack provider's
SlackWebhookHook, and any JSON webhook through the HTTP provider's HttpHook. Each is an Airflow
connection named in the spec (alerts.smtp_conn_id, slack_conn_id, webhook_conn_id); what is secret
(the webhook URL, the SMTP password, an Authorization header in the HTTP connection's extra) stays
in the connection. A send is retried briefly; a channel that still fails is logged, never raised:
a broken alert channel must not fail the training task.

Events that fail a task reach people through `RelayAlertNotifier`, the tasks' on_failure_callback
(and on_retry_callback with alerts.on_retry). A task that knows more than the exception says (the
check report, the failed expectations, the quarantine path) alerts itself just before failing, and
the callback then stays quiet: the ledger holds one alert per failure event. Events that fail
nothing (use_frozen, a fallback to an older checkpoint, a recovery) are explicit notify calls.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from airflow.sdk import BaseNotifier

from relay.airflow.form import CHANNELS
from relay.airflow.hooks import checkpoint_store
from relay.airflow.task_ids import RUN_TASK
from relay.common.errors import RelayError
from relay.common.redaction import redact
from relay.ops import run_alerts, runs
from relay.ops.run_alerts import NOT_CONFIGURED, Alert
from relay.ops.run_history import AuditReport
from relay.ops.runs import Run

log = logging.getLogger(__name__)

SEND_ATTEMPTS = 3
SEND_BACKOFF_S = 1.0
SEND_TIMEOUT_S = 10
DEFAULT_FROM = "relay@localhost"


@dataclass(frozen=True)
class Channels:
    emails: tuple[str, ...]
    smtp_conn_id: str
    slack_conn_id: str | None
    webhook_conn_id: str | None

    @classmethod
    def of(cls, spec, params=None) -> Channels:
        """The spec's channels, narrowed by a DAG run's Params (relay.airflow.form): alert_channels picks among
        them (absent: all of them; empty or null, as the form sends a cleared field: none), alert_emails
        replaces the spec's addresses (empty: the spec's; blank lines of the text box are ignored)."""
        params = params or {}
        on = set(params.get("alert_channels", CHANNELS) or ())
        emails = tuple(e.strip() for e in params.get("alert_emails") or () if e and e.strip())
        a = spec.alerts
        return cls(
            (emails or tuple(a.email)) if "email" in on else (),
            a.smtp_conn_id,
            a.slack_conn_id if "slack" in on else None,
            a.webhook_conn_id if "webhook" in on else None,
        )

    def senders(self) -> list[tuple[str, Callable[[Alert], None]]]:
        out: list[tuple[str, Callable[[Alert], None]]] = []
        if self.emails:
            out.append((f"email:{self.smtp_conn_id}", lambda a: send_email(a, self.smtp_conn_id, self.emails)))
        slack, webhook = self.slack_conn_id, self.webhook_conn_id  # locals: narrowed inside the lambdas too
        if slack:
            out.append((f"slack:{slack}", lambda a: send_slack(a, slack)))
        if webhook:
            out.append((f"webhook:{webhook}", lambda a: send_webhook(a, webhook)))
        return out


# ------------------------------------------------------------------------------------- channels
def send_email(alert: Alert, conn_id: str, to: tuple[str, ...]) -> None:
    from airflow.providers.smtp.hooks.smtp import SmtpHook

    with SmtpHook(smtp_conn_id=conn_id) as hook:
        hook.send_email_smtp(
            to=list(to),
            subject=alert.subject(),
            html_content=alert.html(),
            from_email=hook.from_email or DEFAULT_FROM,
            custom_headers={"X-Relay-Alert": alert.kind, "X-Relay-Run": alert.run},
        )


def send_slack(alert: Alert, conn_id: str) -> None:
    from airflow.providers.slack.hooks.slack_webhook import SlackWebhookHook

    SlackWebhookHook(slack_webhook_conn_id=conn_id, timeout=SEND_TIMEOUT_S).send(**alert.slack())


def send_webhook(alert: Alert, conn_id: str) -> None:
    """POST the alert's JSON to the connection's URL (its host may be the whole URL, path included)."""
    from airflow.providers.http.hooks.http import HttpHook

    HttpHook(method="POST", http_conn_id=conn_id).run(
        json=alert.payload(),
        headers={"Content-Type": "application/json"},
        extra_options={"timeout": SEND_TIMEOUT_S, "check_response": True},
    )


def deliver(alert: Alert, channels: Channels) -> dict[str, str]:
    """Send on every channel, each retried briefly; returns {channel: "sent" | "failed: why"}. Never raises."""
    results: dict[str, str] = {}
    for name, send in channels.senders():
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                send(alert)
                results[name] = "sent"
                break
            except Exception as e:  # noqa: BLE001 - any channel error: logged, the task goes on
                if _not_configured(e):  # said once per run by send_once, never an error per alert
                    results[name] = f"{NOT_CONFIGURED}: {str(e).splitlines()[0][:200]}"
                    break
                results[name] = redact(f"failed: {type(e).__name__}: {str(e)[:300]}")
                if attempt == SEND_ATTEMPTS:
                    break
                time.sleep(SEND_BACKOFF_S * attempt)
        if not results[name].startswith(NOT_CONFIGURED):
            level = logging.INFO if results[name] == "sent" else logging.ERROR
            log.log(level, "alert %s via %s: %s", alert.kind, name, results[name])
    if not results:
        log.warning("alert %s: no channel configured (spec alerts.email / slack_conn_id / webhook_conn_id)", alert.kind)
    return results


def _not_configured(error: Exception) -> bool:
    """A missing connection: trying again cannot help, the log says which one to add."""
    from airflow.exceptions import AirflowNotFoundException

    text = str(error).lower()
    return isinstance(error, AirflowNotFoundException) or ("connection" in text and "not found" in text)


# ------------------------------------------------------------------------------------- building alerts
def run_of(context, spec) -> Run:
    """The training run of this DAG run: preflight.run's XCom, else the run Param, else the spec's run. (A
    run name that is not one never gets here: the trigger's params schema refuses it.)"""
    try:
        pushed = context["ti"].xcom_pull(task_ids=RUN_TASK) or {}
    except Exception:  # noqa: BLE001 - no XCom before preflight.run succeeded
        pushed = {}
    asked = str((context.get("params") or {}).get("run") or "").strip()
    return Run.of(spec, pushed.get("run_name") or asked or None, pushed.get("incarnation"))


def alert_for(context, run: Run, kind: str, what: str, **fields) -> Alert:
    """An alert of `kind` raised by this task instance, with the run's newest valid checkpoint."""
    ti = context["ti"]
    return run_alerts.build(
        run,
        kind,
        what,
        lambda: checkpoint_store(run.spec, probe=True),
        dag_id=ti.dag_id,
        dag_run=context["dag_run"].run_id,
        task=ti.task_id,
        try_number=ti.try_number,
        log_url=getattr(ti, "log_url", ""),
        **fields,
    )


def send_once(context, run: Run, alert: Alert, key: str) -> bool:
    """Deliver `alert` unless the event `key` was alerted before; what is delivered is also in the task log."""
    return run_alerts.send_once(run, alert, key, lambda a: deliver(a, Channels.of(run.spec, context.get("params"))))


def event_key(context, spec, kind: str, scope: str = "") -> str:
    """One failure event: this DAG run's task and kind, in this generation of the task. A person's clear
    begins a new generation (Airflow raises the task's max_tries then), so a failure after a clear is a
    new event that reaches people again; the automatic retries of one generation are one event, unless
    alerts.on_retry makes each try its own."""
    ti = context["ti"]
    key = f"{context['dag_run'].run_id}|{ti.task_id}|{kind}|g{getattr(ti, 'max_tries', 0)}"
    if scope:
        return f"{key}|{scope}"
    return f"{key}|try{ti.try_number}" if spec.alerts.on_retry else key


def notify(context, run: Run, kind: str, what: str, *, scope: str = "", **fields) -> Alert:
    """An explicit alert from inside a task."""
    alert = alert_for(context, run, kind, what, **fields)
    send_once(context, run, alert, event_key(context, run.spec, kind, scope))
    return alert


def notify_error(
    context, run: Run, error: RelayError, *, default_kind: str = "task_failed", action: str = "", **fields
) -> Alert:
    """Alert on a Relay error: its first line is what failed, the rest the details, its fix what to do."""
    first, _, rest = error.what.partition("\n")
    todo = f"What to do: {error.fix}" if error.fix else ""
    return notify(
        context,
        run,
        run_alerts.kind_of(error, default_kind),
        first,
        details=rest.strip(),
        action=" ".join(x for x in (action, todo) if x),
        **fields,
    )


def notify_use_frozen(context, run: Run, change: str) -> None:
    """A source changed under a use_frozen run: once per distinct change, not once per chunk."""
    digest = hashlib.sha256(change.encode()).hexdigest()[:16]
    alert = alert_for(
        context,
        run,
        "use_frozen",
        change.partition("\n")[0],
        details=change,
        action="training continues on the frozen copy (data.on_source_change: use_frozen)",
    )
    send_once(context, run, alert, f"use_frozen|{digest}")


def notify_divergence(context, run: Run, report: AuditReport) -> None:
    """The replay audit found steps trained twice that differ (relay.insights.audit): once per set of diverged steps."""
    if report.consistent:
        return
    steps = sorted({d.step for d in report.divergences})
    digest = hashlib.sha256(repr(steps).encode()).hexdigest()[:16]
    alert = alert_for(
        context,
        run,
        "replay_divergence",
        report.summary().partition("\n")[0],
        step=steps[0],
        details=report.summary(),
        action="training goes on; compare the runs (relay audit RUN_DIR), and look for state the resume "
        "did not restore (an RNG, the dataloader's position, a setting that changed); for verl on "
        "GPUs, state the noise you accept per metric in the spec's audit.tolerance",
    )
    send_once(context, run, alert, f"replay_divergence|{digest}")


def notify_resharded(context, run: Run, result) -> None:
    """A checkpoint was resharded to the spec's world size (checkpoints.on_world_size_change: reshard): once per
    step and world size, however many tries of the chunk see it."""
    alert = alert_for(
        context,
        run,
        "resharded",
        result.explain(),
        step=result.step,
        action=f"training goes on at world size {result.to_world_size}; the world-size-"
        f"{result.from_world_size} original is kept in {result.original}",
    )
    send_once(context, run, alert, f"resharded|{result.step}|{result.to_world_size}")


def notify_deadline(context, run: Run, eta) -> None:
    """The run's ETA (relay.insights.eta) is past alerts.deadline: once per deadline, however many chunks see it."""
    alert = alert_for(
        context,
        run,
        "deadline",
        f"run {run} will miss its deadline: {eta.describe()}",
        action="training goes on; to make the deadline, give the run more GPUs or fewer steps, or move "
        "alerts.deadline (nothing changes automatically)",
    )
    send_once(context, run, alert, f"deadline|{eta.deadline}")


def deadline_missed(spec_path: str, context: dict | None = None, **_) -> None:
    """Airflow's deadline alert on a run DAG (DeadlineReference.FIXED_DATETIME of alerts.deadline): one of its
    DAG runs is still going when the run should be done. Airflow calls it in the executor with the DAG run as
    JSON (`context["dag_run"]`), no task instance: the alert is built from the spec and the run's folder."""
    dag_run = (context or {}).get("dag_run") or {}
    conf = dag_run.get("conf") or {}
    when = dag_run.get("logical_date")
    logical = datetime.fromisoformat(str(when).replace("Z", "+00:00")) if when else None
    spec = runs.spec_at(spec_path, logical)  # a scheduled spec: this DAG run's training run is <name>-<logical date>
    run = Run.of(spec, runs.asked_run_name(spec, conf.get("run"), logical))
    step, uri = run_alerts.last_valid(run, lambda: checkpoint_store(spec, probe=True))
    alert = Alert(
        kind="deadline",
        run=run.name,
        spec=spec.name,
        dag_id=dag_run.get("dag_id", ""),
        dag_run=dag_run.get("dag_run_id", ""),
        step=step,
        last_valid_step=step,
        last_valid_uri=uri,
        what=f"DAG run {dag_run.get('dag_run_id', '?')} is still going at the run's deadline "
        f"{spec.alerts.deadline}, at step {step or 0} of {spec.total_steps}",
        action="training goes on; decide whether the run may run late (Airflow's deadline alert)",
    )
    send_once({"params": conf}, run, alert, f"deadline_missed|{dag_run.get('dag_run_id')}")


def notify_recovery(context, run: Run, what: str, *, whole_run: bool = False, **fields) -> None:
    """The work that failed has succeeded: one message that closes its open failure alerts. A task closes
    the failures of its own task (a chunk that is done closes that chunk's failures, not another's that
    has not run again yet); the run's `finish` (whole_run) closes every one left."""
    if not run.spec.alerts.recovery:
        return
    resolves = _close_failures(context, run, whole_run)
    if not resolves:
        return
    ti = context["ti"]
    alert = alert_for(context, run, "recovered", what, resolves=resolves, action="nothing to do; the run goes on", **fields)
    send_once(context, run, alert, f"recovered|{context['dag_run'].run_id}|{ti.task_id}|{ti.try_number}")


def notify_finished(context, run: Run, what: str, *, details: str, **fields) -> None:
    """The run finished. With alerts.on_finish, one alert that says so with `details` (its goodput) and closes
    every failure still open; without, only the recovery message, when failures were open (with them too)."""
    if not run.spec.alerts.on_finish:
        notify_recovery(context, run, what, whole_run=True, details=details, **fields)
        return
    resolves = _close_failures(context, run, whole_run=True) if run.spec.alerts.recovery else []
    alert = alert_for(
        context,
        run,
        "finished",
        what,
        details=details,
        resolves=resolves or [],
        action="nothing to do: the run is complete",
        **fields,
    )
    send_once(context, run, alert, f"finished|{context['dag_run'].run_id}")


def _close_failures(context, run: Run, whole_run: bool) -> list[str]:
    """Close the run's open failure alerts (this task's, or all with whole_run); what each one was."""
    return run_alerts.close_failures(run, None if whole_run else context["ti"].task_id)


# ------------------------------------------------------------------------------------- the notifier
class RelayAlertNotifier(BaseNotifier):
    """on_failure_callback of every task of a run DAG (and on_retry_callback with alerts.on_retry).

    Quiet when the failing try already alerted with its own details; otherwise one alert built from
    the exception: a chunk that failed after its last retry, a publication that failed after its
    retries, or any other task.
    """

    def __init__(self, spec_path: str, *, retry: bool = False):
        super().__init__()
        self.spec_path = spec_path
        self.retry = retry

    def notify(self, context) -> None:
        ti = context["ti"]
        spec = runs.spec_at(self.spec_path)
        run = run_of(context, spec)
        if run_alerts.alerted_in_try(run, context["dag_run"].run_id, ti.task_id, ti.try_number):
            return
        error = context.get("exception")
        text = str(error) if error is not None else "the task failed (no exception was passed to the callback)"
        first, _, rest = text.partition("\n")
        kind = "retry" if self.retry else run_alerts.kind_of(error, _failure_kind(ti.task_id))
        alert = alert_for(context, run, kind, first, details=rest.strip(), chunk=_chunk_of(ti.task_id))
        resume = f"the run resumes from step {alert.last_valid_step or 0}"  # last_valid read once, S3 included
        if self.retry:
            alert.action = f"Airflow retries the task (try {ti.try_number + 1} of {ti.max_tries + 1}); {resume}"
        else:
            alert.action = (
                f"Airflow gave up after try {ti.try_number}; this DAG run stops here, nothing is lost. "
                f"Clear the task (or trigger with run={run}) and {resume}"
            )
        if (cause := getattr(error, "cause", None)) is not None:  # a failed chunk's classified cause (operators)
            alert.cause, alert.step = cause.describe(), cause.step if cause.step is not None else alert.step
            alert.action += f". What to do: {cause.todo}"
        scope = f"try{ti.try_number}" if self.retry else ""
        send_once(context, run, alert, event_key(context, spec, kind, scope))


def _failure_kind(task_id: str) -> str:
    return {"train": "chunk_failed", "publish": "publish_failed"}.get(task_id.rpartition(".")[2], "task_failed")


def _chunk_of(task_id: str) -> int | None:
    group = task_id.partition(".")[0]
    return int(group[6:]) if group.startswith("chunk_") and group[6:].isdigit() else None
