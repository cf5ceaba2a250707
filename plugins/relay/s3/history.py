"""A run's history beside its checkpoints in S3: its metrics rows (metrics.jsonl, and the first tries of steps
trained again, metrics.superseded.jsonl), its events (events.jsonl) and its record (.relay/run.json).

It is published with each checkpoint, so that a run resumed on a host that lost its folder (restored from S3)
keeps every step's row and every event, not only its weights; and with the report, which is rebuilt from it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from relay.common import files
from relay.common.filelock import file_lock
from relay.common.timestamps import epoch
from relay.runs import layout
from relay.runs.folder import RunFolder
from relay.runs.metrics import SUPERSEDED, read_jsonl
from relay.runs.record import RECORD, read_record
from relay.s3.store import CheckpointStore

ROWS = (layout.METRICS, SUPERSEDED, layout.EVENTS)  # JSONL, one row a line


def where(run_dir: Path, name: str) -> Path:
    """Where a history file lives in a run folder."""
    return layout.relay_dir(run_dir, RECORD) if name == RECORD else Path(run_dir) / name


def publish(store: CheckpointStore, folder: RunFolder) -> list[str]:
    """Put the run's history under <prefix>/<run>/; the names put."""
    run, run_dir = folder.name, folder.path
    put = []
    with store.fenced(folder, "publishing the run's history") as w:  # never into a newer incarnation's prefix
        for name in ROWS:
            path = where(run_dir, name)
            if path.is_file():
                # One read, one PUT: the next chunk's trainer may be appending to the file right now.
                w.put_bytes(store.run_key(run, name), path.read_bytes(), "application/x-ndjson")
                put.append(name)
        record = read_record(run_dir)
        if record:
            w.put_json(store.run_key(run, RECORD), record)
            put.append(RECORD)
    return put


def fetch(store: CheckpointStore, run: str, run_dir: Path) -> list[str]:
    """Download the run's published history into `run_dir`, laid out as a run folder; the names found."""
    got = []
    for name in (*ROWS, RECORD):
        if store.head(store.run_key(run, name)) is not None:
            store.download_object(store.run_key(run, name), where(run_dir, name))
            got.append(name)
    return got


def restore(store: CheckpointStore, folder: RunFolder, step: int) -> list[str]:
    """After a restore brought checkpoint `step` into `run_dir`: bring back the history the folder lacks (a new
    host's folder lacks all of it). Rows of steps up to `step` that the folder has no row of are taken from S3;
    S3's rows of later steps become first tries (metrics.superseded.jsonl), since they are trained again from
    `step`; events and first tries the folder lacks are added, in time order. What the folder holds is kept."""
    run, run_dir = folder.name, folder.path
    with tempfile.TemporaryDirectory(dir=layout.relay_dir(run_dir)) as tmp:
        got = [n for n in fetch(store, run, Path(tmp)) if n in ROWS]
        published = {name: read_jsonl(where(Path(tmp), name)) for name in got}
    if not published:
        return []
    local = {name: read_jsonl(where(run_dir, name)) for name in (layout.METRICS, SUPERSEDED)}
    rows = {r.get("step"): r for r in local[layout.METRICS]}
    again = []
    for r in published.get(layout.METRICS, []):
        if r.get("step") in rows:
            continue
        if isinstance(r.get("step"), int) and r["step"] <= step:
            rows[r["step"]] = r
        else:
            again.append(dict(r, superseded_by=f"a restore of step {step}"))
    merged = {
        layout.METRICS: sorted(rows.values(), key=lambda r: r.get("step") or 0),
        SUPERSEDED: _union(local[SUPERSEDED], published.get(SUPERSEDED, []) + again),
    }
    changed = []
    folder.lease().fence("restoring the run's history")  # never an old incarnation's history into a new one
    for name, new in merged.items():
        if new != local[name]:
            _write_rows(where(run_dir, name), new)
            changed.append(name)
    # Events are written meanwhile (the train task's phase marks, the gate's): read, merged and replaced under the
    # lock every event writer takes (relay.runs.metrics.record_event), so that none written meanwhile is lost.
    events = where(run_dir, layout.EVENTS)
    with file_lock(layout.relay_dir(run_dir, "events.lock"), f"restoring the events of run {run}"):
        folder.lease().fence("restoring the run's events")
        mine = read_jsonl(events)
        new = sorted(_union(mine, published.get(layout.EVENTS, [])), key=_when)
        if new != mine:
            _write_rows(events, new)
            changed.append(layout.EVENTS)
    return changed


def _when(row: dict) -> float:
    """An event's real time: events carry ISO times, and times Ray recorded as epoch seconds."""
    return epoch(row.get("time")) or 0.0


def _write_rows(path: Path, rows: list[dict]) -> None:
    files.atomic_write(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode())


def _union(mine: list[dict], theirs: list[dict]) -> list[dict]:
    """Mine, then theirs that mine lacks (the same row twice is one row)."""
    seen = {json.dumps(r, sort_keys=True) for r in mine}
    out = list(mine)
    for r in theirs:
        key = json.dumps(r, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out
