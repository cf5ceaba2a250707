"""One file lock for every writer of a run folder: an fcntl lock with a bounded wait that names its holder.

Used by the run's lease (every tracker write and checkpoint move), the alert ledger and events.jsonl.
The lock file holds who took it last (host, pid, what for), so a writer that gives up after `timeout`
says who kept it. Re-entrant within a thread: a function that holds it may call one that takes it
again (a restore inside a resume, say) without deadlocking on its own lock. fcntl locks hold on local
disks and on NFSv4-style shared storage.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from relay.common.errors import RelayError
from relay.common.timestamps import utc_now

DEFAULT_TIMEOUT_S = 120.0

_local = threading.local()  # .held: {lock path: depth} of this thread


class LockTimeout(RelayError):
    """A run-folder lock was held by someone else for longer than a writer waits."""

    retry_helps = True


@contextlib.contextmanager
def file_lock(path: Path, what: str, timeout: float = DEFAULT_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for `what`; wait at most `timeout` seconds."""
    key = str(Path(path).resolve())
    held = _local.__dict__.setdefault("held", {})
    if held.get(key):
        held[key] += 1
        try:
            yield
        finally:
            held[key] -= 1
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockTimeout(
                        f"{path} was held for more than {timeout:g} s by {_holder(fd)}; {what} did not wait longer",
                        "if that process is gone (a killed host), nothing holds the lock any more and a retry "
                        "goes through; if it is alive, let it finish, or stop it (its Ray job, its `relay` "
                        "command) and retry",
                    ) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "for": what, "since": utc_now()}).encode(), 0
        )
        held[key] = 1
        try:
            yield
        finally:
            held.pop(key, None)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    try:
        h = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {h['pid']} on {h['host']} ({h['for']}, since {h['since']})"
    except (ValueError, KeyError, OSError):
        return "another process"
