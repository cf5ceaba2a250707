"""Retention across processes and chunks, as a separate step after each publication.

verl remembers what to rotate only in memory, so checkpoints from earlier chunks are never deleted
and the disk fills. Relay decides from what is on disk and in S3:

- locally: keep the newest `keep_local` checkpoints that were validated and published; never a
  checkpoint that is not yet published;
- in S3: keep the newest `keep_published`, plus every milestone;
- never the latest valid checkpoint, never a milestone;
- the decision is written (retention.json) before anything is deleted; S3 deletions wait
  `delete_grace_minutes`, so a reader in the middle of a download is not cut off.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from relay import layout, manifest
from relay.metrics import record_event

STATE = "retention.json"
VERSION = 1


def apply_local(run_dir: Path, policy, total_steps: int, published: set[int]) -> list[int]:
    """Delete local checkpoints beyond keep_local; returns the steps deleted."""
    run_dir = Path(run_dir)
    tracker = layout.read_tracker(run_dir)
    dirs = layout.step_dirs(run_dir)
    real = [s for s, p in dirs.items() if not layout.is_rotation_leftover(p)]
    done = [s for s in real if s in published and (dirs[s] / manifest.NAME).is_file()]
    keep = set(done[-policy.keep_local:]) | {tracker} | {s for s in real if s not in published}
    keep |= {s for s in real if policy.is_milestone(s, total_steps)}
    delete = [s for s in done if s not in keep]
    # verl's rotation leftovers (an empty folder, or data.pt alone) below the tracker are not checkpoints.
    leftovers = [s for s, p in dirs.items() if layout.is_rotation_leftover(p) and tracker and s < tracker]
    if not (delete or leftovers):
        return []
    layout.atomic_write_json(layout.relay_dir(run_dir, STATE), {
        "version": VERSION, "decided_at": _now(), "keep_local": policy.keep_local, "kept": sorted(keep - {None}),
        "deleting": delete, "leftovers": leftovers})
    for s in delete + leftovers:
        shutil.rmtree(dirs[s], ignore_errors=True)
    if delete:
        record_event(run_dir, "retention", where="local", deleted=delete)
    return delete


def apply_published(store, run: str, policy, total_steps: int, now: float | None = None) -> dict:
    """Mark published checkpoints beyond keep_published for deletion; delete those past their grace."""
    now = time.time() if now is None else now
    key = store.run_key(run, STATE)
    state = store.get_json(key) or {"version": VERSION, "pending": {}}
    published = [m.step for m in store.published(run)]
    latest = (store.latest(run) or {}).get("step")
    keep = set(published[-policy.keep_published:]) | {latest}
    keep |= {s for s in published if policy.is_milestone(s, total_steps)}
    pending = {k: v for k, v in state.get("pending", {}).items() if int(k) not in keep and int(k) in published}
    for s in published:
        if s not in keep:
            pending.setdefault(str(s), now)
    due = sorted(int(k) for k, t in pending.items() if now - t >= policy.delete_grace_minutes * 60)
    state = {"version": VERSION, "decided_at": _now(), "keep_published": policy.keep_published,
             "kept": sorted(s for s in keep if s is not None), "pending": pending, "deleting": due}
    store.put_json(key, state)  # the decision is recorded before anything is deleted
    for s in due:
        store.delete_checkpoint(run, s)
        pending.pop(str(s), None)
    if due:
        store.put_json(key, dict(state, pending=pending, deleting=[], deleted=due))
    return {"deleted": due, "pending": sorted(int(k) for k in pending), "kept": state["kept"]}


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
