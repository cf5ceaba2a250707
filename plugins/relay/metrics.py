"""Per-step metrics (metrics.jsonl) and run events (events.jsonl), beside the checkpoints.

metrics.jsonl keeps exactly one row per step. When a chunk resumes from step S, the rows an earlier
attempt wrote after S describe steps that are trained again; they move to metrics.superseded.jsonl.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable

from relay.layout import EVENTS, METRICS, atomic_write

SUPERSEDED = "metrics.superseded.jsonl"


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; a torn last line (a writer killed mid-line) is ignored."""
    rows = []
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return rows
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _dump(rows: Iterable[dict]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


class MetricsLog:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / METRICS
        self.superseded_path = Path(run_dir) / SUPERSEDED
        self._fh = None

    def rows(self) -> list[dict]:
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


def record_event(run_dir: Path, event: str, **fields: Any) -> dict:
    """Append a run event (chunk attempt started, resumed from step S, finished...) to events.jsonl."""
    row = {"event": event, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **fields}
    path = Path(run_dir) / EVENTS
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
    return row


def read_events(run_dir: Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / EVENTS)
