"""The two ways Relay writes a time: in records (UTC, seconds, ISO 8601) and in names (a compact UTC
stamp, for archived folders, quarantined checkpoints and incarnation ids, that sorts as it reads)."""

from __future__ import annotations

import time


def utc_now() -> str:
    """2026-12-01T03:15:38Z: the timestamp of every record Relay writes."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def utc_stamp() -> str:
    """20261201T031538Z: the time in a file or folder name."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
