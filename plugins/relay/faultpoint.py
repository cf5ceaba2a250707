"""Fault points: where the fault suite (tests/faults/) makes a process pause, so that its kill, a
stopped server or a full disk lands exactly there. Off unless RELAY_FAULT_PAUSE_AT is set."""

from __future__ import annotations

import os
import time
from pathlib import Path

FAULT_ENV = "RELAY_FAULT_PAUSE_AT"
# The trainer's points, in the order a step reaches them (the kill matrix draws from these). A publish
# has one more: publish_files, its files uploaded, its manifest and `latest` not yet.
FAULT_PHASES = ("after_step", "mid_save", "before_fsync", "before_rename", "after_rename", "after_tracker")


def fault_point(phase: str, step: int) -> None:
    """A test hook. With RELAY_FAULT_PAUSE_AT=<phase>@<step> (or just <phase>) in the environment, print a
    marker line and sleep here (RELAY_FAULT_PAUSE_S, default 600 s), so that a fault test's SIGKILL lands
    exactly at this point: after a step's row, inside a checkpoint's save (mid_save), before its fsync,
    before or after its rename, after its tracker write. With RELAY_FAULT_ONCE=<file> as well, only the
    first process to get here pauses (it creates <file>, holding its pid: later attempts of a chunk, which
    share the job's environment, go on), and the pause ends early once <file>.go exists, so a test can let
    the process continue after it has done its part (stopped a server, filled a disk, moved a lease).
    Without the variable: one dict lookup."""
    want = os.environ.get(FAULT_ENV)
    if not want:
        return
    name, _, at = want.partition("@")
    if name != phase or (at and at != str(step)):
        return
    once = os.environ.get("RELAY_FAULT_ONCE")
    if once:
        try:
            fd = os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    print(f"[relay-fault] paused at {phase} step {step} pid {os.getpid()}", flush=True)
    deadline = time.time() + float(os.environ.get("RELAY_FAULT_PAUSE_S", "600"))
    go = Path(f"{once}.go") if once else None
    while time.time() < deadline and not (go and go.exists()):
        time.sleep(0.05)
