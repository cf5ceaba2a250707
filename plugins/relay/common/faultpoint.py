"""Fault points: where the fault suite (tests/faults/) makes a process pause, so that its kill, a
stopped server or a full disk lands exactly there, or where a drill (the demo's provoked resume) makes
a trainer crash. Off unless RELAY_FAULT_PAUSE_AT, _KILL_AT or _ALLOC_AT is set."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from relay.common.errors import RelayError

FAULT_ENV = "RELAY_FAULT_PAUSE_AT"
KILL_ENV = "RELAY_FAULT_KILL_AT"  # <phase>@<step>: the process SIGKILLs itself there (a crash, an OOM kill)
# <phase>@<step>: the process caps its own address space (RELAY_FAULT_ALLOC_MB above what it uses, default 256)
# and allocates until Python raises MemoryError, as a trainer that exhausts a memory limit does
ALLOC_ENV = "RELAY_FAULT_ALLOC_AT"
# <what>[,<what>...]: what the system refuses, as some do (rename_exchange: renameat2's RENAME_EXCHANGE, EINVAL
# on NFS and other filesystems), so that the fallback a refusal takes is tested where the system allows it
REFUSE_ENV = "RELAY_FAULT_REFUSE"
# <what>@<step>: what a trainer loses there, as some frameworks do (inflight: a batch of prompts in flight, before
# the save of that step), so that the check that must catch the loss is tested against a real one
DROP_ENV = "RELAY_FAULT_DROP_AT"
# The trainer's points, in the order a step reaches them (the kill matrix draws from these). A publish
# has two more: publish_files, its files uploaded, its manifest and `latest` not yet; publish_manifest, its
# manifest written, `latest` not yet.
FAULT_PHASES = ("after_step", "mid_save", "before_fsync", "before_rename", "after_rename", "after_tracker")


def fault_point(phase: str, step: int) -> None:
    """A test hook. With RELAY_FAULT_PAUSE_AT=<phase>@<step> (or just <phase>) in the environment, print a
    marker line and sleep here (RELAY_FAULT_PAUSE_S, default 600 s), so that a fault test's SIGKILL lands
    exactly at this point: after a step's row, inside a checkpoint's save (mid_save), before its fsync,
    before or after its rename, after its tracker write. With RELAY_FAULT_ONCE=<file> as well, only the
    first process to get here pauses (it creates <file>, holding its pid: later attempts of a chunk, which
    share the job's environment, go on), and the pause ends early once <file>.go exists, so a test can let
    the process continue after it has done its part (stopped a server, filled a disk, moved a lease).
    With RELAY_FAULT_KILL_AT=<phase>@<step> instead, the process SIGKILLs itself there, as a crash or
    an OOM kill would: nothing is saved on the way out (RELAY_FAULT_ONCE works alike). Without either
    variable: two dict lookups."""
    if _armed(KILL_ENV, phase, step):
        print(f"[relay-fault] killed at {phase} step {step} pid {os.getpid()}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if _armed(ALLOC_ENV, phase, step):
        print(f"[relay-fault] exhausting memory at {phase} step {step} pid {os.getpid()}", flush=True)
        exhaust_memory(int(os.environ.get("RELAY_FAULT_ALLOC_MB", "256")))
    if not _armed(FAULT_ENV, phase, step):
        return
    once = _once_file(phase)
    print(f"[relay-fault] paused at {phase} step {step} pid {os.getpid()}", flush=True)
    deadline = time.time() + float(os.environ.get("RELAY_FAULT_PAUSE_S", "600"))
    go = Path(f"{once}.go") if once else None
    while time.time() < deadline and not (go and go.exists()):
        time.sleep(0.05)


def refused(what: str) -> bool:
    """Whether the fault suite makes the system refuse `what` here (RELAY_FAULT_REFUSE); one lookup when unset."""
    return what in os.environ.get(REFUSE_ENV, "").split(",")


def dropped(what: str, step: int) -> bool:
    """Whether the fault suite makes the trainer lose `what` at this step (RELAY_FAULT_DROP_AT; ONCE works alike)."""
    return _armed(DROP_ENV, what, step)


def exhaust_memory(headroom_mb: int) -> None:
    """Cap this process's address space at what it maps now plus headroom_mb, then allocate 16 MiB blocks
    until Python raises MemoryError (the cap keeps the rest of the machine out of it)."""
    import resource

    mapped = (
        int(
            next(
                line.split()[1] for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmSize:")
            )
        )
        * 1024
    )
    resource.setrlimit(resource.RLIMIT_AS, (mapped + headroom_mb * 2**20, resource.getrlimit(resource.RLIMIT_AS)[1]))
    hog = []
    while True:
        hog.append(bytearray(16 * 2**20))


def _once_file(phase: str) -> str | None:
    """RELAY_FAULT_ONCE's file for this point: `{point}` in it is the point's name, so that processes that share one
    environment (Airflow's, in a test module) can each arm a point of their own, once."""
    once = os.environ.get("RELAY_FAULT_ONCE")
    return once.replace("{point}", phase) if once else None


def _armed(var: str, phase: str, step: int) -> bool:
    """Whether `var` names this point, and (with RELAY_FAULT_ONCE) this is the first process to reach it."""
    want = os.environ.get(var)
    if not want:
        return False
    points = [p.partition("@") for p in want.split(",")]  # several points, each once (`{point}` in RELAY_FAULT_ONCE)
    if not any(name == phase and (not at or at == str(step)) for name, _, at in points):
        return False
    once = _once_file(phase)
    if once:
        try:
            fd = os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
    return True


def drill_env(drill: Any, once_file: Path) -> dict[str, str]:
    """A drill asked for in a DAG run's conf ({"relay_fault": {"kill_at": "after_step@34"}}): the job
    environment that arms it, once per DAG run and chunk (the demo's provoked resume; a team's own
    drill of a crash). Bad input is an error that says what is accepted."""

    kill_at = drill.get("kill_at") if isinstance(drill, dict) else None
    phase, _, step = str(kill_at).partition("@")
    if set(drill or {}) != {"kill_at"} or phase not in FAULT_PHASES or not step.isdigit():
        raise RelayError(
            f"conf relay_fault {str(drill)[:80]!r} is not a drill Relay runs",
            f'give {{"kill_at": "<phase>@<step>"}} with a phase among {", ".join(FAULT_PHASES)}, '
            'e.g. {"kill_at": "after_step@34"}',
            retry_helps=False,
        )
    once_file.parent.mkdir(parents=True, exist_ok=True)
    return {KILL_ENV: f"{phase}@{int(step)}", "RELAY_FAULT_ONCE": str(once_file)}
