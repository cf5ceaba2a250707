"""A commit record per committed step, outside the step folder, so that a step's certificate cannot be removed to get
past it (relay.checkpoints.certificate).

`.relay/commits/global_step_N.json` is written by the commit, under the run's lock and before the tracker names the
step (verl's tracker file stays a bare step number): the digest of the step's certificate file as committed, or why
there is none (`skipped`: the trainer could not compute it, or wrote none). A resume, and the gate, read a step's
standing from it:

- certified: the record names a certificate, and the step folder holds that very file;
- refused: the record names a certificate that is gone or changed, or the step has no record though it was
  committed after the run began keeping them (a record removed with it): refused as a failed certificate is;
- skipped: the record says why there is none: it may resume uncertified (unless checkpoints.require_certificate);
- unrecorded: committed before the run kept records (an older Relay): it may resume uncertified alike.

A restore from S3 or a reshard writes the step's record again from what it committed. Records are small and never
deleted with their step: a step of the same number committed later writes its own.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.checkpoints import certificate
from relay.common import files
from relay.common.timestamps import utc_now
from relay.runs import layout

FOLDER = "commits"


def path(run_dir: Path, step: int) -> Path:
    return layout.relay_dir(run_dir, FOLDER, f"{layout.step_name(step)}.json")


def certificate_digest(step_dir: Path) -> str | None:
    """The sha256 of the step folder's certificate file as it is now; None if it has none."""
    try:
        return hashlib.sha256((Path(step_dir) / certificate.NAME).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def write(run_dir: Path, step: int, step_dir: Path, *, skipped: str | None = None, by: str = "") -> dict[str, Any]:
    """Record step `step` as committed from `step_dir` (call under the run's lock, before the tracker moves): its
    certificate's digest, or `skipped` (why there is none). The record, as written (durable)."""
    return _write(run_dir, step, certificate_digest(step_dir), skipped, by)


def restored(run_dir: Path, step: int, step_dir: Path, published: str | None, *, by: str) -> dict[str, Any]:
    """The commit record of a step restored from its publication, whose manifest says `published` of its certificate
    (None: published before commit records): the publication's digest, so that a certificate that is not the one
    published is refused at the resume; or skipped, for the reason the publication gives."""
    if published and not published.startswith("skipped: "):
        return _write(run_dir, step, published, None, by)
    why = published.removeprefix("skipped: ") if published else None
    return write(run_dir, step, step_dir, skipped=why or "published without a certificate", by=by)


def _write(run_dir: Path, step: int, digest: str | None, skipped: str | None, by: str) -> dict[str, Any]:
    record: dict[str, Any] = {"step": step, "certificate": digest, "by": by, "time": utc_now()}
    if digest is None:
        record["skipped"] = skipped or "the trainer wrote no certificate"
    target = path(run_dir, step)
    target.parent.mkdir(parents=True, exist_ok=True)
    files.atomic_write_json(target, record)
    return record


def read(run_dir: Path, step: int) -> dict[str, Any] | None:
    try:
        record = json.loads(path(run_dir, step).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def summary(record: dict[str, Any] | None) -> str | None:
    """What a checkpoint event and a manifest carry: the certificate's digest, or "skipped: <why>"."""
    if record is None:
        return None
    return record.get("certificate") or f"skipped: {record.get('skipped')}"


@dataclass(frozen=True)
class Standing:
    kind: str  # certified | refused | skipped | unrecorded
    detail: str

    @property
    def uncertified(self) -> bool:
        return self.kind in ("skipped", "unrecorded")


def standing(run_dir: Path, step: int, step_dir: Path | None = None) -> Standing:
    """What step `step`'s commit record says of the certificate now in its folder (see the module's docstring)."""
    step_dir = step_dir or layout.step_dir(run_dir, step)
    record = read(run_dir, step)
    now = certificate_digest(step_dir)
    if record is None:
        recorded = _recorded_steps(run_dir)
        if recorded and step >= min(recorded):
            return Standing(
                "refused",
                f"{layout.step_name(step)} has no commit record (.relay/{FOLDER}/), though the run keeps one for every "
                f"step committed since step {min(recorded)}: the record was removed, or the step was not committed by "
                "Relay",
            )
        return Standing("unrecorded", "committed before the run kept commit records")
    want = record.get("certificate")
    if want is None:
        return Standing("skipped", f"no certificate at its commit: {record.get('skipped')}")
    if now is None:
        return Standing(
            "refused", f"its certificate was removed: the commit recorded one ({want[:16]}), the folder holds none"
        )
    if now != want:
        return Standing(
            "refused", f"its certificate was replaced since its commit (recorded {want[:16]}, the folder's {now[:16]})"
        )
    return Standing("certified", f"the certificate recorded at its commit ({want[:16]})")


def _recorded_steps(run_dir: Path) -> list[int]:
    folder = layout.relay_dir(run_dir, FOLDER)
    steps = []
    for p in folder.glob("global_step_*.json") if folder.is_dir() else ():
        tail = p.stem.rpartition("_")[2]
        if tail.isdigit():
            steps.append(int(tail))
    return steps
