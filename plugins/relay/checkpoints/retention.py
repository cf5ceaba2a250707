"""Retention across processes and chunks, as a separate step after each publication.

verl remembers what to rotate only in memory, so checkpoints from earlier chunks are never deleted
and the disk fills. Relay decides from what is on disk and in S3:

- locally: keep the newest `keep_local` checkpoints that were validated and published; never a
  checkpoint that is not yet published;
- in S3: keep the newest `keep_published`, plus every milestone;
- never the latest valid checkpoint, never a milestone, never one of the `keep_best` k best by its step's
  metric (metrics.jsonl: the same ranking in every process and chunk, since it is read from the run's files);
- the decision, with why each checkpoint is kept, is written (retention.json) before anything is deleted; S3
  deletions wait
  `delete_grace_minutes`, so a reader in the middle of a download is not cut off;
- what was set aside (superseded attempts, quarantined checkpoints, verl's rollout state, older Hugging
  Face exports) goes once S3 holds a whole copy of its step: never the only copy of anything.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from relay.checkpoints import manifest
from relay.common import files
from relay.common.timestamps import utc_now
from relay.runs import layout
from relay.runs.lease import Lease
from relay.runs.metrics import read_jsonl, record_event

STATE = "retention.json"
VERSION = 1


class BestPolicy(Protocol):
    """What retention reads of the spec's checkpoints.keep_best (relay.spec.run_spec.KeepBest)."""

    @property
    def metric(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def k(self) -> int: ...


class RetentionPolicy(Protocol):
    """What retention reads of the spec's checkpoints policy (relay.spec.run_spec.CheckpointPolicy): the
    checkpoints layer knows no spec."""

    @property
    def keep_local(self) -> int: ...
    @property
    def keep_published(self) -> int: ...
    @property
    def delete_grace_minutes(self) -> float: ...
    @property
    def keep_best(self) -> BestPolicy | None: ...
    def is_milestone(self, step: int, total_steps: int) -> bool: ...


class RetentionStore(Protocol):
    """What retention asks of the run's store (relay.s3.store.CheckpointStore, a layer above)."""

    def run_key(self, run: str, *parts: str) -> str: ...
    def get_json(self, key: str) -> dict[str, Any] | None: ...
    def put_json(self, key: str, obj: object) -> None: ...
    def published(self, run: str) -> list[manifest.Manifest]: ...
    def latest(self, run: str) -> dict[str, Any] | None: ...
    def delete_checkpoint(self, run: str, step: int) -> int: ...


def apply_local(
    run_dir: Path, policy: RetentionPolicy, total_steps: int, published: set[int], *, incarnation: str | None = None
) -> list[int]:
    """Delete local checkpoints beyond keep_local, and leftovers that are no longer the only copy of
    anything (leftovers()); returns the checkpoint steps deleted. Under the run's lock: a trainer's commit
    or a gate's quarantine waits for it, and it for them. `incarnation`: the run's life this retention is for (a
    publish task's); once the run was started again it deletes nothing (LeaseLost)."""
    run_dir = Path(run_dir)
    lease = Lease(run_dir, incarnation=incarnation)
    with lease.locked("applying local retention"):
        lease.fence("applying local retention")
        tracker = layout.read_tracker(run_dir)
        dirs = layout.step_dirs(run_dir)
        real = [s for s, p in dirs.items() if not layout.is_rotation_leftover(p)]
        done = [s for s in real if s in published and (dirs[s] / manifest.NAME).is_file()]
        why = reasons(run_dir, policy, total_steps, done, newest=policy.keep_local, latest=tracker)
        for s in real:
            if s not in published:
                why.setdefault(s, []).append("not published yet")
        keep = set(why)
        delete = [s for s in done if s not in keep]
        # verl's rotation leftovers (an empty folder, or data.pt alone) below the tracker are not checkpoints.
        rotation = [s for s, p in dirs.items() if layout.is_rotation_leftover(p) and tracker and s < tracker]
        aside = leftovers(run_dir, published)
        if not (delete or rotation or aside):
            return []
        files.atomic_write_json(
            layout.relay_dir(run_dir, STATE),
            {
                "version": VERSION,
                "decided_at": _now(),
                "keep_local": policy.keep_local,
                "kept": sorted(keep),
                "why": {str(s): r for s, r in sorted(why.items())},
                "deleting": delete,
                "leftovers": rotation,
                "aside": [str(p.relative_to(run_dir)) for p in aside],
            },
        )
        for path in [dirs[s] for s in delete + rotation] + aside:
            shutil.rmtree(path, ignore_errors=True)
    if delete or aside:
        record_event(run_dir, "retention", where="local", deleted=delete, aside=[str(p.relative_to(run_dir)) for p in aside])
    return delete


def reasons(
    run_dir: Path | None, policy: RetentionPolicy, total_steps: int, steps: list[int], *, newest: int, latest: int | None
) -> dict[int, list[str]]:
    """{step: why it is kept} among `steps` (ascending): the newest `newest`, the latest, milestones, and the
    keep_best k best by their step's metric in the run's metrics.jsonl (none without the run's folder)."""
    why: dict[int, list[str]] = {}
    for s in steps[-newest:]:
        why.setdefault(s, []).append(f"among the newest {newest}")
    if latest is not None:
        why.setdefault(latest, []).append("the latest (the tracker's)")
    for s in steps:
        if policy.is_milestone(s, total_steps):
            why.setdefault(s, []).append("a milestone")
    for s, said in best_steps(run_dir, policy.keep_best, steps).items():
        why.setdefault(s, []).append(said)
    return why


def best_steps(run_dir: Path | None, keep_best: BestPolicy | None, steps: list[int]) -> dict[int, str]:
    """{step: why} of the keep_best k best of `steps` by the metric of their metrics.jsonl row (the newer wins a
    tie); steps whose row lacks the metric are not ranked."""
    if keep_best is None or run_dir is None:
        return {}
    rows = {r["step"]: r for r in read_jsonl(Path(run_dir) / layout.METRICS) if isinstance(r.get("step"), int)}
    m = keep_best.metric
    scored = [
        (float(rows[s][m]), s)
        for s in steps
        if s in rows
        and isinstance(rows[s].get(m), (int, float))
        and not isinstance(rows[s].get(m), bool)
        and math.isfinite(rows[s][m])
    ]
    ranked = sorted(scored, key=lambda vs: (-vs[0] if keep_best.mode == "max" else vs[0], -vs[1]))
    return {
        s: f"best {m} ({keep_best.mode}): #{i + 1} of {keep_best.k}, {v:.6g}"
        for i, (v, s) in enumerate(ranked[: keep_best.k])
    }


ASIDE_STEP = re.compile(r"global_step_([0-9]{1,18})(\.|\Z)")


def leftovers(run_dir: Path, published: set[int]) -> list[Path]:
    """What Relay and verl set aside that may go, because S3 holds a whole copy of the step it came from:
    .relay/superseded/ (a killed attempt's renamed folder, or a local copy a restore replaced),
    .relay/quarantine/ (an invalid checkpoint; its .report.json stays), .relay/rollout_state/ (verl's
    rollout-engine state moved out of a step folder), and hf/ exports but the newest (verl's model
    merger rebuilds any from its published checkpoint). Nothing here is ever the only copy of a step."""
    out = []
    for corner in ("superseded", "quarantine", "rollout_state"):
        folder = layout.relay_dir(run_dir, corner)
        for p in sorted(folder.iterdir()) if folder.is_dir() else []:
            m = ASIDE_STEP.match(p.name)
            if p.is_dir() and m and int(m.group(1)) in published:
                out.append(p)
    hf = {
        int(m.group(1)): p
        for p in sorted((Path(run_dir) / layout.HF_DIR).glob("global_step_*"))
        if (m := ASIDE_STEP.match(p.name)) and p.is_dir()
    }
    out += [p for s, p in hf.items() if s in published and s < max(hf)]
    return out


def apply_published(
    store: RetentionStore,
    run: str,
    policy: RetentionPolicy,
    total_steps: int,
    now: float | None = None,
    run_dir: Path | None = None,
    incarnation: str | None = None,
) -> dict[str, Any]:
    """Mark published checkpoints beyond keep_published for deletion; delete those past their grace. run_dir:
    the run's folder, whose metrics.jsonl ranks the steps for keep_best. With run_dir and `incarnation` (a publish
    task's), nothing is deleted once the run was started again (checked before each deletion; LeaseLost)."""
    fence = Lease(run_dir, incarnation=incarnation).fence if run_dir is not None and incarnation else None
    now = time.time() if now is None else now
    key = store.run_key(run, STATE)
    state = store.get_json(key) or {"version": VERSION, "pending": {}}
    published = [m.step for m in store.published(run)]
    latest = (store.latest(run) or {}).get("step")
    why = reasons(run_dir, policy, total_steps, published, newest=policy.keep_published, latest=latest)
    keep = set(why)
    pending = {k: v for k, v in state.get("pending", {}).items() if int(k) not in keep and int(k) in published}
    for s in published:
        if s not in keep:
            pending.setdefault(str(s), now)
    due = sorted(int(k) for k, t in pending.items() if now - t >= policy.delete_grace_minutes * 60)
    state = {
        "version": VERSION,
        "decided_at": _now(),
        "keep_published": policy.keep_published,
        "kept": sorted(keep),
        "why": {str(s): r for s, r in sorted(why.items())},
        "pending": pending,
        "deleting": due,
    }
    if fence:
        fence("applying the published checkpoints' retention")
    store.put_json(key, state)  # the decision is recorded before anything is deleted
    for s in due:
        if fence:
            fence(f"deleting published step {s}")
        store.delete_checkpoint(run, s)
        pending.pop(str(s), None)
    if due:
        store.put_json(key, dict(state, pending=pending, deleting=[], deleted=due))
    return {"deleted": due, "pending": sorted(int(k) for k in pending), "kept": state["kept"]}


def _now() -> str:
    return utc_now()
