"""Per-step metrics (metrics.jsonl) and run events (events.jsonl), beside the checkpoints.

metrics.jsonl keeps exactly one row per step. When a chunk resumes from step S, the rows an earlier
attempt wrote after S describe steps that are trained again; they move to metrics.superseded.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

from relay.common.errors import RunError
from relay.common.filelock import file_lock
from relay.common.files import atomic_write
from relay.common.timestamps import event_time
from relay.runs.layout import EVENTS, METRICS, relay_dir

SUPERSEDED = "metrics.superseded.jsonl"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file. A torn line (a writer killed mid-line) is skipped, said on stderr, and kept in
    the file; appends start on a line of their own after it (record_event), so no later row is lost."""
    rows: list[dict[str, Any]] = []
    torn = 0
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return rows
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            torn += bool(line.strip())
    if torn:
        print(
            f"[relay] {path}: {torn} unreadable line(s) skipped (a writer killed mid-line; kept in the file)",
            file=sys.stderr,
        )
    return rows


def readable_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a run's JSONL file that a command examines (`relay audit`, `relay report`): RunError (a finding) when
    the file holds lines but none is a row, a corrupt history rather than one with nothing in it yet."""
    rows = read_jsonl(path)
    if not rows and Path(path).is_file() and Path(path).read_bytes().strip():
        raise RunError(
            f"{path} is unreadable: it holds lines, and none of them is a JSON row",
            "restore the run's history from S3 (`relay checkpoint restore` brings it back with a checkpoint), or move "
            "the file aside to examine the rest of the run",
        )
    return rows


def _dump(rows: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


class MetricsLog:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS
        self.superseded_path = Path(run_dir) / SUPERSEDED
        self._fh: TextIO | None = None

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path)

    def resume_at(self, step: int, attempt: str) -> int:
        """Keep rows up to `step`; move later ones aside. Returns how many were superseded."""
        rows = self.rows()
        keep = [r for r in rows if r.get("step", 0) <= step]
        later = [dict(r, superseded_by=attempt) for r in rows if r.get("step", 0) > step]
        if later:
            with open(self.superseded_path, "ab") as f:
                f.write(_dump(later))
        if later or len(keep) != len(rows) or self.path.exists():
            atomic_write(self.path, _dump(keep))
        return len(later)

    def append(self, row: dict[str, Any]) -> None:
        if self._fh is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)
        self._fh.write(json.dumps(row, sort_keys=True) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class JsonlFollower:
    """The rows appended to a JSONL file since the last call, read from where the last call stopped: what a poll
    reads grows with what was appended, not with the file. A line not yet whole waits for the next call; a file
    rewritten meanwhile (a resume supersedes rows by writing it anew) is read again from its start."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.bytes_read = 0
        self._inode: int | None = None
        self._partial = b""

    def new_rows(self) -> list[dict[str, Any]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        if st.st_ino != self._inode or st.st_size < self.offset:
            self._inode, self.offset, self._partial = st.st_ino, 0, b""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        self.offset += len(data)
        self.bytes_read += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        rows = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a torn line (a writer killed mid-line): read_jsonl says so where it matters
        return rows


def record_event(run_dir: Path, event: str, **fields: Any) -> dict[str, Any]:
    """Append a run event (chunk attempt started, resumed from step S, finished...) to events.jsonl.

    Writers on several hosts (the trainer on a Ray node, the gate in an Airflow worker) take turns under
    a lock, each writes its line at the file's end, and a line torn by a killed writer is closed first, so
    that it never swallows the next event. The end is found and written at explicitly, as an NFS client
    does for O_APPEND: no filesystem is trusted to append atomically, the lock alone orders the writers."""
    row = {"event": event, "time": event_time(), **fields}  # `time` in fields (a time Ray recorded) wins
    path = Path(run_dir) / EVENTS
    line = (json.dumps(row, sort_keys=True) + "\n").encode()
    with file_lock(relay_dir(run_dir, "events.lock"), f"recording the event {event}"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            written = 0
            while written < len(line):
                written += os.pwrite(fd, line[written:], size + written)
        finally:
            os.close(fd)
    return row


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(Path(run_dir) / EVENTS)
