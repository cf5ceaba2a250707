"""Where a run resumes: the newest valid checkpoint, with invalid ones quarantined and the tracker
re-pointed, instead of crashing on a broken shard or silently starting again at step 0.

Quarantine moves a checkpoint folder to .relay/quarantine/ with its check report beside it: never
deleted, never published, never resumed from. When nothing valid is left locally, the newest
valid published checkpoint is restored from the store (S3), if the run has one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.checkpoints import swap
from relay.checkpoints.validate import CheckReport, validate_checkpoint
from relay.common.errors import CheckpointError, RelayError
from relay.common.faultpoint import fault_point
from relay.common.timestamps import utc_stamp
from relay.runs import layout
from relay.runs.lease import Lease
from relay.runs.metrics import record_event

QUARANTINE = "quarantine"


@dataclass
class ResumePoint:
    step: int  # 0: a fresh start
    quarantined: list[dict[str, Any]] = field(default_factory=list)  # {"step", "check", "detail", "path"}
    restored_from: str | None = None  # the store URI a restore came from
    report: CheckReport | None = None

    @property
    def fell_back(self) -> bool:
        return bool(self.quarantined)


def quarantine(run_dir: Path, report: CheckReport) -> Path:
    """Move an invalid checkpoint aside with its report (under the run's lock); re-point nothing."""
    with Lease(run_dir).locked(f"quarantining step {report.step}"):
        return _quarantine(Path(run_dir), report)


def quarantine_locked(run_dir: Path, report: CheckReport) -> Path:
    """quarantine() for a caller that holds the run's lock (the gate, which checks first that the folder is the one
    it validated)."""
    return _quarantine(Path(run_dir), report)


def _quarantine(run_dir: Path, report: CheckReport) -> Path:
    assert report.step is not None  # callers quarantine a step folder that exists: the report names its step
    src = layout.step_dir(run_dir, report.step)
    stamp = utc_stamp()
    dest = layout.relay_dir(run_dir, QUARANTINE, f"{src.name}.{stamp}")
    n = 1
    while dest.exists():  # the same step quarantined again within the second: never overwrite the first
        dest, n = layout.relay_dir(run_dir, QUARANTINE, f"{src.name}.{stamp}-{n}"), n + 1
    dest.parent.mkdir(parents=True, exist_ok=True)
    src.rename(dest)
    (dest.parent / f"{dest.name}.report.json").write_text(report.to_json())
    failed = report.failed
    assert failed is not None  # only invalid reports are quarantined: one of their checks failed
    record_event(run_dir, "quarantine", step=report.step, check=failed.name, detail=failed.detail, path=str(dest))
    return dest


def quarantined(run_dir: Path) -> list[dict[str, Any]]:
    """Reports of a run's quarantined checkpoints, oldest first."""
    folder = layout.relay_dir(run_dir, QUARANTINE)
    out = []
    for p in sorted(folder.glob("*.report.json")) if folder.is_dir() else []:
        try:
            out.append(dict(json.loads(p.read_text()), quarantine_path=str(p).removesuffix(".report.json")))
        except ValueError:
            continue
    return out


def find_resume_point(
    run_dir: Path,
    *,
    restore: Callable[..., tuple[int, str] | None] | None = None,
    smoke: Callable[[Path], str] | None = None,
) -> ResumePoint:
    """Validate candidates newest first (the tracker's, then older step folders); quarantine the
    invalid ones; point the tracker at the first valid one. `restore(run_dir, above=N)` (from the store)
    is asked first for a published checkpoint newer than that one when a newer local one was refused
    (its published copy is whole: no step is trained twice), and for any when no local checkpoint is
    valid. Raises when checkpoints existed and none is valid anywhere.
    """
    run_dir = Path(run_dir)
    if done := swap.recover(run_dir):  # a reshard killed mid-swap: global_step_N whole again first
        print(f"[relay] {done}", flush=True)
    point = ResumePoint(0)
    seen = _tracker_bytes(run_dir)  # what every tracker move below expects to find: a compare-and-swap
    try:
        tracker = layout.read_tracker(run_dir)
    except CheckpointError as e:
        tracker = None
        point.quarantined.append({"step": None, "check": "structure", "detail": e.what, "path": None})
        _set_aside_tracker(run_dir, seen)
        seen = None
    candidates = sorted(
        (s for s, p in layout.step_dirs(run_dir).items() if not layout.is_rotation_leftover(p)), reverse=True
    )
    if tracker is not None and tracker not in candidates:
        point.quarantined.append(
            {
                "step": tracker,
                "check": "structure",
                "path": None,
                "detail": f"the tracker names global_step_{tracker}, which does not exist",
            }
        )
    for step in candidates:
        if tracker is not None and step > tracker:
            continue  # written after the tracker last moved: never committed (e.g. killed mid-publish)
        report = validate_checkpoint(run_dir, step, smoke=smoke)
        if report.ok:
            if point.quarantined and restore is not None and (restored := _restore_newer(restore, run_dir, step)):
                point.step, point.restored_from = restored
                return point
            if tracker != step:
                fault_point("before_fallback", step)
                with Lease(run_dir).locked(f"pointing the tracker back at step {step}"):
                    now = _tracker_bytes(run_dir)
                    if now == seen:
                        layout.write_tracker(run_dir, step)
                if now != seen:  # a commit (a live job's) moved it while the candidates were validated
                    print(
                        f"[relay] the tracker moved to step {_shown(now)} while step {step} was validated to fall "
                        "back to: it is left as it is, and resuming is looked at again from there",
                        flush=True,
                    )
                    again = find_resume_point(run_dir, restore=restore, smoke=smoke)
                    again.quarantined[:0] = point.quarantined
                    return again
                record_event(run_dir, "fallback", step=step, tracker_was=tracker)
            point.step, point.report = step, report
            return point
        dest = quarantine(run_dir, report)
        failed = report.failed
        assert failed is not None  # the report is not ok: one of its checks failed
        point.quarantined.append({"step": step, "check": failed.name, "detail": failed.detail, "path": str(dest)})
    if restore is not None:
        restored = restore(run_dir)
        if restored is not None:
            point.step, point.restored_from = restored
            return point
    if point.quarantined or quarantined(run_dir):
        _set_aside_tracker(run_dir, seen)
        why = "; ".join(f"step {q['step']}: {q['check']} failed: {q['detail']}" for q in point.quarantined)
        raise CheckpointError(
            f"run {run_dir.name} has no valid checkpoint left ({why or 'all were quarantined earlier'}); "
            f"refusing to start again at step 0",
            f"inspect {layout.relay_dir(run_dir, QUARANTINE)}; restore a published checkpoint with "
            f"`python -m relay checkpoint restore`, or trigger with fresh_start to start from step 0",
        )
    return point


def _restore_newer(restore: Callable[..., tuple[int, str] | None], run_dir: Path, step: int) -> tuple[int, str] | None:
    """A published checkpoint newer than local `step`, or None; an unreachable store is no reason to fail
    when a valid local checkpoint is there."""

    try:
        return restore(run_dir, above=step)
    except RelayError as e:
        print(f"[relay] no newer published checkpoint looked at ({e.what}); resuming from local step {step}", flush=True)
        return None


def _tracker_bytes(run_dir: Path) -> bytes | None:
    """The tracker as it is now, whatever it holds (None: no tracker)."""
    try:
        return layout.tracker_path(run_dir).read_bytes()[: layout.TRACKER_MAX_BYTES + 1]
    except (FileNotFoundError, IsADirectoryError):
        return None


def _shown(tracker: bytes | None) -> str:
    return tracker.decode("utf-8", "replace").strip()[:20] if tracker is not None else "none"


def _set_aside_tracker(run_dir: Path, seen: bytes | None) -> None:
    """A tracker that names nothing valid must not survive: verl would start from scratch with it. Only the
    tracker that was refused (`seen`) is set aside: one a commit wrote since is left alone."""
    t = layout.tracker_path(run_dir)
    with Lease(run_dir).locked("setting a refused tracker aside"):
        if t.exists() and _tracker_bytes(run_dir) == seen:
            dest = layout.relay_dir(run_dir, QUARANTINE, f"{layout.TRACKER}.{int(time.time() * 1e3)}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            t.rename(dest)
