"""One writer per run: a lease with a fencing token, kept in the run folder.

Before a chunk's job is submitted, the submitter takes the lease and gets a new, larger token. The
trainer carries its token and checks it before every save, inside the same file lock that taking
the lease needs. So once a newer attempt holds the lease, an older trainer (an orphan that outlived
its Ray job, say) can no longer write a checkpoint: its commit is refused. The lock is an fcntl
lock on the run folder's storage, so it holds on local disks and on NFSv4-style shared storage.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from relay.errors import LeaseLost
from relay.layout import atomic_write_json, relay_dir

LEASE = "lease.json"
LOCK = "lease.lock"


class Lease:
    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = relay_dir(run_dir, LEASE)
        self.lock_path = relay_dir(run_dir, LOCK)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def current(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None

    def acquire(self, holder: str) -> int:
        """Take the lease for `holder` and return its new fencing token. Waits for a commit in progress."""
        with self._locked():
            token = int((self.current() or {}).get("token", 0)) + 1
            atomic_write_json(self.path, {
                "token": token, "holder": holder, "host": socket.gethostname(), "pid": os.getpid(),
                "acquired_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            })
            return token

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
        with self._locked():
            self.check(token)
            yield
