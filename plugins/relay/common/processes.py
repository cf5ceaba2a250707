"""Is a process still the one we saw? A pid and its start time name a process; a pid alone may have been
given to another process since."""

from __future__ import annotations

import psutil


def started_at(pid: int | None = None) -> float:
    """When process `pid` (default: this one) started, as psutil reports it (epoch seconds)."""
    created: float = psutil.Process(pid).create_time()
    return created


def runs(pid: int, started: float | None) -> bool:
    """Whether process `pid` that started at `started` still runs (not a zombie, not a new process given the
    same pid). started=None: any process with that pid counts."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and (started is None or abs(proc.create_time() - started) < 0.01)
    except psutil.Error:
        return False
