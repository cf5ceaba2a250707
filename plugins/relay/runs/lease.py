"""One writer per run: a lease with a fencing token, kept in the run folder.

When a chunk's job is submitted, the submitter (the train task) takes the lease for that job and gets
a new, larger token, which the job's request carries (the CLI takes it in its own process). The
trainer checks its token when it starts (and records its host and pid in the lease) and before every
save, inside the same file lock that taking the lease needs; the gate, a restore and retention hold
that lock too for every tracker write and checkpoint move. So once a newer attempt holds the lease,
an older trainer (an orphan that outlived its Ray job, say) can no longer write a checkpoint: its
commit is refused. The lock is an fcntl lock on the run folder's storage, so it holds on local disks
and on NFSv4-style shared storage.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Iterator

from relay.common.errors import LeaseLost
from relay.common.filelock import DEFAULT_TIMEOUT_S, file_lock
from relay.common.timestamps import utc_now
from relay.runs.layout import atomic_write_json, relay_dir

LEASE = "lease.json"
LOCK = "lease.lock"


class Lease:
    def __init__(self, run_dir: Path, timeout: float = DEFAULT_TIMEOUT_S):
        self.run_dir = Path(run_dir)
        self.path = relay_dir(run_dir, LEASE)
        self.lock_path = relay_dir(run_dir, LOCK)
        self.timeout = timeout

    def locked(self, what: str) -> contextlib.AbstractContextManager:
        """Hold the run's lock without taking a new token: for every tracker write and checkpoint move that
        is not a trainer's commit (the gate's quarantine, a restore, retention). A wait is bounded."""
        return file_lock(self.lock_path, f"{what} (run {self.run_dir.name})", self.timeout)

    def current(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None

    def acquire(self, holder: str) -> int:
        """Take the lease for `holder` and return its new fencing token. Waits for a commit in progress."""
        with self.locked(f"taking the lease for {holder}"):
            token = int((self.current() or {}).get("token", 0)) + 1
            atomic_write_json(self.path, {
                "token": token, "holder": holder, "host": socket.gethostname(), "pid": os.getpid(),
                "acquired_at": utc_now(),
            })
            return token

    def claim(self, token: int) -> None:
        """The trainer that a submission's token was taken for starts: check the token, and record this
        process as the lease's writer (host and pid: what `relay doctor` and a person look for)."""
        with self.locked(f"starting the trainer of token {token}"):
            self.check(token)
            current = self.current()
            assert current is not None  # check() just found the lease, and the lock is held
            atomic_write_json(self.path, {**current, "host": socket.gethostname(), "pid": os.getpid(),
                                          "trainer_started_at": utc_now()})

    def holds(self, holder: str) -> bool:
        """Whether `holder` (a Ray submission id, say) holds the lease now."""
        return (self.current() or {}).get("holder") == holder

    def check(self, token: int) -> None:
        """Raise LeaseLost unless `token` still holds the lease."""
        cur = self.current()
        if cur is None or int(cur["token"]) != int(token):
            holder = cur and f"{cur.get('holder')} (token {cur.get('token')}, since {cur.get('acquired_at')})"
            raise LeaseLost(
                f"run {self.run_dir.name}: this trainer holds lease token {token}, but the lease is now held by "
                f"{holder or 'nobody'}; refusing to write",
                "nothing to do: a newer attempt of this run owns it; this process stops without saving",
            )

    @contextlib.contextmanager
    def commit(self, token: int) -> Iterator[None]:
        """Hold the lease lock while a checkpoint is published; refuse if `token` lost the lease."""
        with self.locked(f"committing a checkpoint with token {token}"):
            self.check(token)
            yield
