"""One writer per run: a lease with a fencing token, kept in the run folder.

When a chunk's job is submitted, the submitter (the train task) takes the lease for that job and gets
a new, larger token, which the job's request carries (the CLI takes it in its own process). The
trainer checks its token when it starts (and records its host and pid in the lease) and before every
save, inside the same file lock that taking the lease needs; the gate, a restore and retention hold
that lock too for every tracker write and checkpoint move. So once a newer attempt holds the lease,
an older trainer (an orphan that outlived its Ray job, say) can no longer write a checkpoint: its
commit is refused. The lock is an fcntl lock on the run folder's storage, so it holds on local disks
and on NFSv4-style shared storage.

A token is bound to the run's incarnation (relay.runs.record) it was taken in, and a fresh start carries the
counter into the new incarnation's lease, one past the last token of the old one: a trainer of the old life
that is still alive (an orphan, a job on another node) holds a token that no writer of the new life has,
and an incarnation that is not the folder's, so its next check refuses it either way.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relay.common.errors import LeaseLost, RunError
from relay.common.filelock import DEFAULT_TIMEOUT_S, file_lock
from relay.common.files import atomic_write_json
from relay.common.processes import runs, started_at
from relay.common.timestamps import utc_now
from relay.runs.layout import relay_dir
from relay.runs.record import folder_incarnation

LEASE = "lease.json"
FRESH_START_PENDING = "fresh_start_pending"  # a fresh start's decision (relay.preflight.prepare): no token is handed out
LOCK = "lease.lock"


class Lease:
    def __init__(self, run_dir: Path, timeout: float = DEFAULT_TIMEOUT_S, *, incarnation: str | None = None):
        self.run_dir = Path(run_dir)
        self.path = relay_dir(run_dir, LEASE)
        self.lock_path = relay_dir(run_dir, LOCK)
        self.timeout = timeout
        # The life of the run this writer writes for (its request's); else pinned by acquire() or claim().
        self.incarnation = incarnation

    def locked(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Hold the run's lock without taking a new token: for every tracker write and checkpoint move that
        is not a trainer's commit (the gate's quarantine, a restore, retention). A wait is bounded."""
        return file_lock(self.lock_path, f"{what} (run {self.run_dir.name})", self.timeout)

    def current(self) -> dict[str, Any] | None:
        try:
            lease: dict[str, Any] = json.loads(self.path.read_text())
            return lease
        except FileNotFoundError:
            return None

    def acquire(self, holder: str) -> int:
        """Take the lease for `holder` and return its new fencing token. Waits for a commit in progress."""
        with self.locked(f"taking the lease for {holder}"):
            current = self.current() or {}
            self._refuse_pending(current, f"{holder} cannot take its lease")
            token = int(current.get("token", 0)) + 1
            here = folder_incarnation(self.run_dir)
            self._refuse_other_life(here, token)
            self.incarnation = self.incarnation or here
            atomic_write_json(
                self.path,
                {
                    "token": token,
                    "incarnation": here,
                    "holder": holder,
                    **_this_process(),
                    "acquired_at": utc_now(),
                },
            )
            return token

    def carry_forward(self, last_token: int, incarnation: str | None) -> None:
        """A fresh start's new lease: nobody holds it, and its next token comes after every token of the
        archived incarnation (`last_token`, its newest, is burned too: a submission that took it while the
        run was moved aside finds it taken)."""
        with self.locked("carrying the lease's tokens into the new incarnation"):
            atomic_write_json(
                self.path, {"token": int(last_token) + 1, "incarnation": incarnation, "holder": "", "carried_at": utc_now()}
            )

    def claim(self, token: int) -> None:
        """The trainer that a submission's token was taken for starts: check the token, and record this
        process as the lease's writer (host and pid: what `relay doctor` and a person look for)."""
        with self.locked(f"starting the trainer of token {token}"):
            self.check(token)
            current = self.current()
            assert current is not None  # check() just found the lease, and the lock is held
            self.incarnation = self.incarnation or current.get("incarnation")
            atomic_write_json(self.path, {**current, **_this_process(), "trainer_started_at": utc_now()})

    def fence(self, what: str) -> None:
        """A write that holds no token (an Airflow task's phase mark, failure record, validation or publication; a
        manual command): refused (LeaseLost) once the run was started again after this writer's incarnation, or while
        a fresh start of it is under way. Read without the lock: an append never waits behind a slow holder."""
        self._refuse_pending(self.current() or {}, f"{what} refused")
        here = folder_incarnation(self.run_dir) if self.run_dir.is_dir() else None
        if self.incarnation and here != self.incarnation:
            raise LeaseLost(
                f"run {self.run_dir.name}: {what} refused: it is for incarnation {self.incarnation}, but the run was "
                f"started again since (its folder holds {f'incarnation {here}' if here else 'no run'}); nothing was "
                "written",
                "nothing to do: this task's DAG run trained the old incarnation; trigger a new DAG run for the new one",
            )

    def _refuse_pending(self, current: dict[str, Any], what: str) -> None:
        """LeaseLost while a fresh start of the run is decided and not finished (relay.preflight.prepare)."""
        if isinstance(pending := current.get(FRESH_START_PENDING), dict):
            raise LeaseLost(
                f"run {self.run_dir.name}: a fresh start that {pending.get('asked_by')} decided at {pending.get('at')} "
                f"is moving the run aside; {what}",
                "nothing to do for this writer; trigger the run again once the fresh start has finished (the next "
                "prepare finishes an interrupted one)",
            )

    def holds(self, holder: str) -> bool:
        """Whether `holder` (a Ray submission id, say) holds the lease now."""
        return (self.current() or {}).get("holder") == holder

    def check(self, token: int) -> None:
        """Raise LeaseLost unless `token` still holds the lease, in this writer's incarnation of the run."""
        cur = self.current()
        if cur is None or int(cur["token"]) != int(token):
            holder = (
                cur
                and f"{cur.get('holder') or 'nobody'} (token {cur.get('token')}, since "
                f"{cur.get('acquired_at') or cur.get('carried_at')})"
            )
            raise LeaseLost(
                f"run {self.run_dir.name}: this trainer holds lease token {token}, but the lease is now held by "
                f"{holder or 'nobody'}; refusing to write",
                "nothing to do: a newer attempt of this run owns it; this process stops without saving",
            )
        self._refuse_other_life(cur.get("incarnation") or folder_incarnation(self.run_dir), token)

    def _refuse_other_life(self, here: str | None, token: int) -> None:
        if self.incarnation and here and here != self.incarnation:
            raise LeaseLost(
                f"run {self.run_dir.name}: this writer belongs to incarnation {self.incarnation} (lease token "
                f"{token}), but the run was started again since: its folder holds incarnation {here}; refusing "
                "to write",
                "nothing to do: this process stops without writing; the new incarnation's chunks go on",
            )

    def writer(self) -> tuple[bool, str] | None:
        """The trainer that holds the lease, when one may still run: (True, who) when it runs on this host,
        (False, who) when it ran on another host, where this one cannot see whether it still runs (its
        fencing token keeps it out of a new incarnation either way); None when nobody holds the lease or its
        process on this host has ended."""
        cur = self.current() or {}
        host, pid = cur.get("host"), cur.get("pid")
        if not cur.get("holder") or not isinstance(pid, int):
            return None
        who = f"pid {pid} on {host} ({cur['holder']}, lease token {cur.get('token')})"
        if host != socket.gethostname():
            return False, who
        return (True, who) if runs(pid, cur.get("pid_started")) else None

    @contextlib.contextmanager
    def commit(self, token: int) -> Iterator[None]:
        """Hold the lease lock while a checkpoint is published; refuse if `token` lost the lease."""
        with self.locked(f"committing a checkpoint with token {token}"):
            self.check(token)
            yield


def take_for_operator(run_dir: Path, what: str, *, force: bool = False, flag: str = "--force") -> int | None:
    """A person's command that writes into a run (a manual restore): it takes the lease like any writer, under an
    operator's identity (user, host, pid), so that a trainer it outruns is fenced out. Refused while the lease's
    trainer is alive on this host, unless `force` (the command's `flag`). None for a folder that holds nothing yet."""
    lease = Lease(run_dir)
    if not (Path(run_dir).is_dir() and any(Path(run_dir).iterdir())):
        return None
    writer = lease.writer()
    if writer is not None and writer[0] and not force:
        raise RunError(
            f"{what} into {run_dir} refused: the run has a live writer: {writer[1]}",
            f"stop it first (`ray job stop ID`, or end the `relay train` process); or pass {flag} to take the run "
            "from it: its next save is refused and it stops without writing",
        )
    if writer is not None and not writer[0]:
        print(f"[relay] {what}: a writer this host cannot see holds the lease ({writer[1]}); it is fenced out", flush=True)
    return lease.acquire(f"{what} by {getpass.getuser()} ({socket.gethostname()}:{os.getpid()})")


def _this_process() -> dict[str, Any]:
    """Who writes: host, pid, and the process's start time, so a pid reused by another process is not taken
    for a live writer."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": started_at()}
