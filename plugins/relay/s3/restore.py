"""Bring a published checkpoint back into a run folder: the local side of S3 (the store only moves bytes).

The newest published checkpoint of the run's own incarnation is downloaded into staging (ranged, concurrent
GETs; each file's CRC64NVME checked as it arrives, and each whole file put through the gate's per-file checks,
integrity, loadability and numerics, while the others download), moved into place under the run's lease,
validated at every level like any local checkpoint from those per-file results (quarantined and skipped if it
fails), and only then named by the tracker.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from relay.checkpoints import commits
from relay.checkpoints.resume import quarantine
from relay.checkpoints.validate import check_file, validate_checkpoint
from relay.common.errors import CheckpointError, LeaseLost
from relay.common.faultpoint import fault_point
from relay.runs import layout
from relay.runs.folder import RunFolder
from relay.runs.lease import Lease
from relay.runs.record import VERSION as RECORD_VERSION
from relay.runs.record import folder_incarnation, incarnation_of, write_record
from relay.runs.run import Run
from relay.s3 import history
from relay.s3.store import CheckpointStore, StoreError, store_for_spec


def restore(
    store: CheckpointStore,
    folder: RunFolder,
    *,
    step: int | None = None,
    above: int = 0,
    log: Callable[[str], None] = print,
    token: int | None = None,
) -> tuple[int, str] | None:
    """Restore the newest valid published checkpoint of the run's incarnation (at most `step`, newer than
    `above`) into the run's folder; set the tracker. folder.incarnation None: the one S3 holds (a restore on
    purpose, `relay checkpoint restore`); a folder that holds another incarnation is refused. A folder without a
    run record gets the published one.

    Candidates are tried newest first; one of another incarnation is never taken, one that fails its
    checksums or its validation is skipped. Returns (step, uri), or None when nothing valid is published. `token`:
    the lease token of a person's restore, checked again when the step moves in.
    """
    run, run_dir = folder.name, Path(folder.path)
    incarnation = folder.incarnation or store.incarnation(run)
    local = folder_incarnation(run_dir) if run_dir.is_dir() else None
    if local is not None and incarnation is not None and local != incarnation:
        raise StoreError(
            f"{run_dir} holds incarnation {local} of run {run}; {store.uri}/{run}/ holds incarnation "
            f"{incarnation}: restoring would mix two runs under one name",
            "restore into another folder, or move this one aside first",
        )
    _remove_leftovers(run_dir)
    # The tracker moves by compare-and-swap: only if it still names what it named here, so that a checkpoint a
    # writer committed while this restore downloaded is never hidden behind an older one.
    expected = layout.read_tracker(run_dir) if run_dir.is_dir() else None
    for s in sorted(store.steps(run), reverse=True):
        if (step is not None and s > step) or s <= above:
            continue
        try:
            m = store.manifest(run, s)
        except CheckpointError as e:  # a damaged or altered manifest: never followed, an older one is tried
            log(f"skipping {store.step_uri(run, s)}: {e.what}")
            continue
        if m is None:
            continue  # an incomplete publication
        if incarnation is not None and m.incarnation != incarnation:
            log(f"skipping {store.step_uri(run, s)}: it is of incarnation {m.incarnation} of run {run}, not {incarnation}")
            continue
        uri = store.step_uri(run, m.step)
        staging = layout.relay_dir(run_dir, "staging", f"{RESTORE_STAGING}{layout.step_name(m.step)}")
        try:  # each file is checked (integrity, loadability, numerics) as soon as it is in, while others download
            # on_file runs within this iteration only
            checked = store.download(run, m, staging, on_file=lambda rel, _path: check_file(staging, rel))  # noqa: B023
        except CheckpointError as e:
            shutil.rmtree(staging, ignore_errors=True)  # preallocated at full size: never kept for the next try
            log(f"skipping {uri}: {e.what}")
            continue
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fault_point("restore_downloaded", m.step)
        lease = Lease(run_dir, incarnation=local)
        with lease.locked(f"restoring step {m.step} from {uri}"):
            try:
                if token is not None:  # a person's restore (relay.runs.lease.take_for_operator): still the run's writer?
                    lease.check(token)
                # The folder is still the run it was when the restore began (an old DAG run's restore after a fresh
                # start, or a new run begun in an empty folder meanwhile: refused), and no fresh start is under way.
                lease.fence(f"restoring step {m.step} from {uri}")
                if local is None and (begun := folder_incarnation(run_dir)) is not None:
                    raise LeaseLost(
                        f"restoring step {m.step} of run {run} into {run_dir} refused: the folder was empty when the "
                        f"restore began and holds incarnation {begun} now; nothing was moved",
                        "nothing to do: the run was started in that folder meanwhile; it trains on from there",
                    )
            except LeaseLost:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            if (now := layout.read_tracker(run_dir)) != expected:
                shutil.rmtree(staging, ignore_errors=True)
                raise CheckpointError(
                    f"restoring step {m.step} of run {run} into {run_dir} refused: its tracker named "
                    f"{_named(expected)} when the restore began and names {_named(now)} now (a writer committed "
                    "meanwhile); nothing was moved",
                    "nothing, if the run trains on from there; to restore anyway, stop the run's writer and run the "
                    "restore again",
                )
            final = layout.step_dir(run_dir, m.step)
            if final.exists():
                aside = layout.relay_dir(run_dir, "superseded", f"{final.name}.{int(time.time() * 1e3)}")
                aside.parent.mkdir(parents=True, exist_ok=True)
                final.rename(aside)
            staging.rename(final)
            # Its commit record, from what the publication's manifest says of its certificate (its files' checksums
            # cover the certificate itself): a restored step resumes under the same check as one trained here.
            commits.restored(run_dir, m.step, final, m.certificate, by=f"restore from {uri}")
            report = validate_checkpoint(run_dir, m.step, checked=checked)
            if not report.ok:
                quarantine(run_dir, report)
                failed = report.failed
                assert failed is not None  # the report is not ok: one of its checks failed
                log(f"skipping {uri}: {failed.name}: {failed.detail}")
                continue
            layout.write_tracker(run_dir, m.step)
            if local is None:
                _restore_record(store, run, run_dir, incarnation, uri)
            history.restore(store, RunFolder(run, run_dir, incarnation), m.step)  # every row and event, not only weights
        RunFolder(run, run_dir, incarnation).record("restore", step=m.step, uri=uri)
        return m.step, uri
    return None


def _named(step: int | None) -> str:
    return f"step {step}" if step is not None else "no checkpoint"


def _remove_leftovers(run_dir: Path) -> None:
    """What a killed restore left in staging (downloads preallocated at full size): a restore starts clean."""
    staging = layout.relay_dir(run_dir, "staging")
    for old in staging.glob(f"{RESTORE_STAGING}*") if staging.is_dir() else ():
        shutil.rmtree(old, ignore_errors=True)


RESTORE_STAGING = "restore-"


def _restore_record(store: CheckpointStore, run: str, run_dir: Path, incarnation: str | None, uri: str) -> None:
    """The run record of a folder that a restore filled: the published one (settings snapshot, frozen data),
    else a minimal one naming the incarnation."""
    record = store.run_record(run)
    if not record or incarnation_of(record) != incarnation:
        record = {"version": RECORD_VERSION, "run": run, "incarnation": incarnation}
    write_record(run_dir, {**record, "restored_from": uri})


def restore_for_resume(run: Run, above: int = 0) -> tuple[int, str] | None:
    """Called by a trainer whose run has no valid local checkpoint newer than `above`: restore one of the run's
    own incarnation (run.incarnation) from S3 if one is published."""
    return restore(store_for_spec(run.spec), run.folder, above=above, log=lambda msg: print(f"[relay] {msg}", flush=True))
