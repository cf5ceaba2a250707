"""Secrets Relay must never write out, and their redaction.

Relay's secrets come only from Airflow connections (S3 keys, SMTP passwords, webhook URLs: Airflow
masks a connection's password and extra when a task reads it) and from environment variables that a
spec's `ray.env_vars` names as `${VAR}` (expanded only when a chunk's job is submitted, and registered
here). Alerts, reports and Relay's own log lines pass through `redact`, which replaces every
registered secret, and every one Airflow's secrets masker knows when Relay runs inside Airflow, by
`***`. The core imports no Airflow: Airflow's masker is used only when Airflow has already been
imported by the process.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

MASK = "***"
MIN_LENGTH = 5  # as Airflow's masker: shorter values would mask ordinary words

_secrets: set[str] = set()
_lock = threading.Lock()


def register(value: Any, name: str | None = None) -> None:
    """Never write `value` out: `redact` replaces it; inside Airflow it is also masked in task logs."""
    if not isinstance(value, str) or len(value) < MIN_LENGTH:
        return
    with _lock:
        _secrets.add(value)
    airflow_log = sys.modules.get("airflow.sdk.log")
    if airflow_log is not None:
        try:
            airflow_log.mask_secret(value, name)
        except Exception:  # noqa: BLE001 - masking in the task log is best effort; redact() still works
            pass


def registered() -> frozenset[str]:
    with _lock:
        return frozenset(_secrets)


def redact(value: Any) -> Any:
    """`value` (a string, or dicts, lists and tuples of them) with every known secret replaced by ***."""
    if isinstance(value, str):
        for secret in sorted(registered(), key=len, reverse=True):
            value = value.replace(secret, MASK)
        airflow_log = sys.modules.get("airflow.sdk.log")
        if airflow_log is not None:
            try:
                value = airflow_log.redact(value)
            except Exception:  # noqa: BLE001
                pass
        return value
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value
