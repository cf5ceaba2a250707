"""Waiting for a condition in a test: one poll loop for a mail that lands, a job that reaches a step, an Airflow
task that changes state."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

FIRST_INTERVAL_S, LAST_INTERVAL_S = 0.05, 0.5


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 10.0,
    what: str | Callable[[], str] = "the condition",
    *,
    gave_up: Callable[[], str | None] | None = None,
) -> Any:
    """Poll predicate() until it returns something truthy, and return that. The first polls come quickly (a mail
    lands in milliseconds), later ones every half second (an Airflow task's state is an API call). Fails naming
    `what` (text, or a function that says what was seen) after `timeout` seconds, or at once when `gave_up()`
    returns a reason (the process being waited on ended, say)."""
    deadline, interval = time.time() + timeout, FIRST_INTERVAL_S
    while True:
        if value := predicate():
            return value
        if gave_up is not None and (reason := gave_up()):
            raise AssertionError(f"gave up waiting for {_text(what)}: {reason}")
        if time.time() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {_text(what)}")
        time.sleep(interval)
        interval = min(interval * 2, LAST_INTERVAL_S)


def _text(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what
