"""A chunk attempt's newest step, in a small file of the run folder that the trainer rewrites at every step
(.relay/progress/<attempt>.json) and the train task's trigger reads at every poll.

The trigger also streams the job's log, but reads only its last lines per poll: a trainer that prints
megabytes between steps (verl at debug level) would hide its step lines from a stall watch that read the log.
This file cannot be hidden, and reading it costs one small read however long the run. It needs no fsync: it
says how far an attempt has come, not what was saved.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from relay.runs.layout import relay_dir

FOLDER = "progress"
MAX_BYTES = 4096


def path(run_dir: Path, attempt: str) -> Path:
    return relay_dir(run_dir, FOLDER, f"{re.sub(r'[^A-Za-z0-9._-]', '_', attempt)}.json")


def beat(run_dir: Path, attempt: str, step: int, *, waiting: bool = False) -> None:
    """Say that `attempt` has trained `step` (written whole: a reader never sees half of it); `waiting`: it is a warm
    chunk's job that waits, at `step`'s save, for its train task's admission (not a stall: the admission limit
    bounds that wait)."""
    target = path(run_dir, attempt)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"step": step, "time": time.time(), **({"waiting": True} if waiting else {})}))
    os.replace(tmp, target)


def read(run_dir: str | Path, attempt: str) -> tuple[int | None, bool]:
    """The newest step `attempt` has said it trained (None before its first, or where the folder cannot be seen from
    here), and whether it now waits for its admission."""
    try:
        with open(path(Path(run_dir), attempt), "rb") as f:
            got = json.loads(f.read(MAX_BYTES))
        step, waiting = got.get("step"), got.get("waiting") is True
    except (OSError, ValueError, AttributeError):
        return None, False
    return (step if isinstance(step, int) and not isinstance(step, bool) else None), waiting


def last_step(run_dir: str | Path, attempt: str) -> int | None:
    """The newest step `attempt` has said it trained (see read)."""
    return read(run_dir, attempt)[0]


def clear(run_dir: Path, attempt: str) -> None:
    """The attempt has ended: its file goes."""
    path(run_dir, attempt).unlink(missing_ok=True)
