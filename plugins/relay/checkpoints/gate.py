"""The gate a chunk's checkpoint passes before anything trusts it: validate every level; record a
manifest when it is whole; otherwise quarantine it, fall back to the newest valid checkpoint, and
say so. Shared by the DAG's validate task, `python -m relay checkpoint validate` and Ray jobs.

A folder and what to check it against come from the caller (relay.preflight.admission reads them from the
run's spec), so the gate knows no spec.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.checkpoints import manifest, swap
from relay.checkpoints.resume import find_resume_point, quarantine_locked
from relay.checkpoints.validate import CheckReport, validate_checkpoint, write_manifest
from relay.common.errors import CheckpointError
from relay.runs import layout
from relay.runs.folder import RunFolder
from relay.runs.lease import Lease
from relay.runs.metrics import record_event


@dataclass
class Admission:
    report: CheckReport
    manifest: manifest.Manifest | None = None
    quarantined_to: str | None = None
    fell_back_to: int | None = None  # the step the tracker names after a quarantine (None: nothing valid)

    @property
    def ok(self) -> bool:
        return self.report.ok

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.report.to_dict(),
            "quarantined_to": self.quarantined_to,
            "fell_back_to": self.fell_back_to,
            "manifest": self.manifest and f"{self.report.path}/{manifest.NAME}",
        }

    def explain(self) -> str:
        if self.ok:
            return self.report.summary()
        fb = (
            f"the tracker now names step {self.fell_back_to}, the next resume starts there"
            if self.fell_back_to
            else "no valid checkpoint is left locally"
        )
        return f"{self.report.summary()}\nquarantined to {self.quarantined_to} (never deleted, never published); {fb}"


def _tracker_or_none(run_dir: Path) -> int | None:
    """The tracker's step; None when there is none or it is garbage (the validation's report says which)."""
    try:
        return layout.read_tracker(run_dir)
    except CheckpointError:
        return None


def _identity(folder: Path) -> tuple[int, int] | None:
    """Which folder a path names now (device and inode): a rename in its place is another folder."""
    try:
        st = folder.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def admit_dir(
    run_dir: Path,
    step: int | None = None,
    *,
    expected_step: int | None = None,
    smoke: Callable[[Path], str] | None = None,
    certify: Callable[[Path], str] | None = None,
    run: str | None = None,
    fingerprint: str | None = None,
    expect_critic: bool | None = None,
    incarnation: str | None = None,
) -> Admission:
    """Validate a checkpoint (default: the tracker's); write its manifest, or quarantine it and fall back.

    `incarnation`: the run's life this validation is for (a DAG run's); once the run was started again, or while a
    fresh start is under way, the gate refuses (LeaseLost) and writes nothing. A folder that fails is quarantined
    only if it is still the folder that was validated (its identity, not its path): one replaced meanwhile (a
    restore, a trainer's commit) is validated again."""
    run_dir = Path(run_dir)
    lease = Lease(run_dir, incarnation=incarnation)
    if incarnation is not None:
        lease.fence(f"validating step {step if step is not None else '(the latest)'}")
    t0 = time.time()
    if run_dir.is_dir() and (done := swap.recover(run_dir)):  # a reshard killed mid-swap
        print(f"[relay] {done}", flush=True)
    for _ in range(3):
        target = step if step is not None else _tracker_or_none(run_dir)
        validated = _identity(layout.step_dir(run_dir, target)) if target is not None else None
        report = validate_checkpoint(
            run_dir, step, expected_step=expected_step, smoke=smoke, certify=certify, expect_critic=expect_critic
        )
        if report.step is not None and run_dir.is_dir():  # what the gate costs a chunk (relay.insights.save_interval)
            event = {"step": report.step, "ok": report.ok, "seconds": round(time.time() - t0, 3)}
            if incarnation is not None:
                RunFolder(run or run_dir.name, run_dir, incarnation).record("validation", **event)
            else:
                record_event(run_dir, "validation", **event)
        if report.ok:
            assert report.step is not None  # a valid report names the step it validated
            step_dir = layout.step_dir(run_dir, report.step)
            return Admission(report, manifest.read(step_dir) or write_manifest(report, run or run_dir.name, fingerprint))
        if report.step is None or not layout.step_dir(run_dir, report.step).is_dir():
            return Admission(report)  # nothing there to quarantine (a missing folder, a garbage tracker)
        with lease.locked(f"quarantining step {report.step}"):
            if incarnation is not None:
                lease.fence(f"quarantining step {report.step}")
            if report.step == target and _identity(layout.step_dir(run_dir, report.step)) == validated:
                dest = quarantine_locked(run_dir, report)
                break
        print(f"[relay] step {report.step} of {run_dir} was replaced while it was validated: validating it again")
    else:
        raise CheckpointError(
            f"step {step} of {run_dir} was replaced three times while the gate validated it; nothing was quarantined",
            "stop the run's other writer (a restore, a trainer), then validate again",
        )
    try:
        fell_back = find_resume_point(run_dir).step or None
    except CheckpointError:
        fell_back = None
    return Admission(report, quarantined_to=str(dest), fell_back_to=fell_back)
