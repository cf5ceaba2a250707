"""A run's alerts as its tasks raise them: each built with the run's newest valid checkpoint (and its URI where S3
holds it), claimed once per event in the run's alert ledger before it is delivered, and closed by a recovery
message once the work that failed succeeds. The front-end names the event and delivers (Airflow's connections)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from relay.alerts import Alert, AlertLedger, kind_of
from relay.checkpoints.validate import latest_valid_step
from relay.runs.run import Run

__all__ = ["Alert", "alerted_in_try", "build", "close_failures", "kind_of", "last_valid", "send_once"]

log = logging.getLogger(__name__)
NOT_CONFIGURED = "not configured"  # a channel's result when its connection does not exist


def last_valid(run: Run, store_of: Callable[[], Any]) -> tuple[int | None, str | None]:
    """The run's newest valid checkpoint and, when S3 holds it, its URI (`store_of`: the run's store, asked only
    then). Best effort: an alert about an unreachable S3 must still go out."""
    try:
        step = latest_valid_step(run.dir)
    except Exception as e:  # noqa: BLE001
        log.warning("alert: cannot read run %s's latest checkpoint: %s", run, e)
        return None, None
    if not step or run.spec.s3 is None:
        return step, None
    try:
        store = store_of()
        return step, store.step_uri(run.name, step) if store.manifest(run.name, step) else None
    except Exception as e:  # noqa: BLE001
        log.warning("alert: cannot ask S3 whether step %s is published: %s", step, e)
        return step, None


def build(run: Run, kind: str, what: str, store_of: Callable[[], Any], **fields: Any) -> Alert:
    """An alert of `kind` about `run`, with where it was raised (`fields`) and its newest valid checkpoint."""
    step, uri = last_valid(run, store_of)
    return Alert(kind=kind, run=run.name, what=what, spec=run.spec.name, last_valid_step=step, last_valid_uri=uri, **fields)


def send_once(run: Run, alert: Alert, key: str, deliver: Callable[[Alert], dict[str, str]]) -> bool:
    """Deliver `alert` (redacted) unless the event `key` was alerted before; whether it was sent. A channel that is
    not configured (its result starts with "not configured") is warned about once per run."""
    alert = alert.redacted()  # secrets (masked connections, expanded ray.env_vars) never leave as text
    ledger, fresh = None, True
    try:
        if run.dir.is_dir():  # a run refused before it had a folder gets none from its alert
            ledger = AlertLedger(run.dir)
            fresh = ledger.claim(key, alert)
    except Exception as e:  # noqa: BLE001 - an unreadable ledger: alert anyway
        log.warning("alert ledger of run %s unavailable (%s): sending without de-duplication", run, e)
    if not fresh:
        log.info("alert %s already sent for this event (%s); not sent again", alert.kind, key)
        return False
    log.warning("ALERT\n%s", alert.text())
    results = deliver(alert)
    for name, result in results.items():
        if result.startswith(NOT_CONFIGURED) and (ledger is None or ledger.first_unconfigured(name)):
            log.warning(
                "alert channel %s is not configured (%s): this run's alerts are not sent there. Add the "
                "connection (docs/guides/alerts.md says how), or remove the channel from the spec's alerts "
                "section; this is said once per run",
                name,
                result.partition(": ")[2],
            )
    if ledger is not None:
        ledger.delivered(key, results)
    return True


def close_failures(run: Run, task: str | None) -> list[str]:
    """Close the run's open failure alerts (those of `task`, or all with None); what each one was."""
    try:
        ledger = AlertLedger(run.dir)
        open_failures = [e for e in ledger.open_failures() if task is None or e.get("task") == task]
    except Exception as e:  # noqa: BLE001
        log.warning("alert ledger of run %s unavailable: %s", run, e)
        return []
    if open_failures:
        ledger.close([e["key"] for e in open_failures])
    return [
        f"{e['kind']}" + (f" at step {e['step']}" if e.get("step") is not None else "") + f" ({e['at']})"
        for e in open_failures
    ]


def alerted_in_try(run: Run, dag_run: str, task: str, try_number: int | None) -> bool:
    """Whether this try of the task already alerted with its own details (then its failure callback stays quiet)."""
    try:
        return AlertLedger(run.dir).alerted_in_try(dag_run, task, try_number)
    except Exception:  # noqa: BLE001 - no ledger: alert
        return False
