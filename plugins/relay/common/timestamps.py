"""The two ways Relay writes a time: in records (UTC, seconds, ISO 8601) and in names (a compact UTC
stamp, for archived folders, quarantined checkpoints and incarnation ids, that sorts as it reads); and when
this process started (a trainer's start-up counts from it)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def utc_now() -> str:
    """2026-12-01T03:15:38Z: the timestamp of every record Relay writes."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def utc_stamp() -> str:
    """20261201T031538Z: the time in a file or folder name."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def process_started() -> float | None:
    """When this process started, in epoch seconds (Linux: /proc/self/stat's start time after the boot time in
    /proc/stat); None where that cannot be read."""
    try:
        after_boot = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return round(boot + after_boot / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError, StopIteration):
        return None
