"""The ways Relay writes a time: in records (UTC, seconds, ISO 8601), in events (the same to the millisecond:
the goodput ledger splits seconds-long chunk boundaries by them) and in names (a compact UTC stamp, for archived
folders, quarantined checkpoints and incarnation ids, that sorts as it reads); how any of them (or epoch seconds)
is read back; and when this process started (a trainer's start-up counts from it)."""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path


def utc_now() -> str:
    """2026-12-01T03:15:38Z: the timestamp of every record Relay writes."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def event_time(at: float | None = None) -> str:
    """2026-12-01T03:15:38.123Z: the time of an event in events.jsonl (now, or at epoch seconds `at`)."""
    at = time.time() if at is None else at
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at * 1000) % 1000:03d}Z"


def epoch(value: object) -> float | None:
    """Epoch seconds of a recorded time: ISO 8601 (with or without a fraction, Z or an offset) or a number;
    None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        when = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None else None


def utc_stamp() -> str:
    """20261201T031538Z: the time in a file or folder name."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def process_started() -> float | None:
    """When this process started, in epoch seconds (Linux: /proc/self/stat's start time after the boot time in
    /proc/stat); None where that cannot be read."""
    try:
        after_boot = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        return round(boot + after_boot / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError, StopIteration):
        return None
