"""A step folder replaced in place, crash-safe: global_step_N names a whole checkpoint at every instant.

Used by a reshard in place. The new step is staged and fsynced first; a journal (`.relay/swap.json`) then
records the three folders (the step, the staged new one, where the original is kept) and the staged folder's
inode, which identifies it after any rename. The two folders then swap in one renameat2(RENAME_EXCHANGE),
and the original is moved aside, kept. Where the filesystem refuses the exchange (EINVAL on NFS and others),
two renames do it: the original aside, then the new one in; between them global_step_N is missing for a
moment. A process killed anywhere leaves the journal behind, and `recover()` (the next reshard, `relay
doctor`, the gate and every resume call it) finishes the swap from where it stopped, or undoes a swap that
had not begun, so the tracker always names a whole checkpoint and the original is never in a staging folder,
where a later reshard would delete it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
from pathlib import Path

from relay.common import files
from relay.common.errors import CheckpointError
from relay.common.faultpoint import fault_point, refused
from relay.runs import layout
from relay.runs.lease import Lease

JOURNAL = "swap.json"


def replace_step(run_dir: Path, step: int, staged: Path, aside: Path) -> None:
    """Put the staged folder in place of global_step_<step>, the original moved to `aside`. The caller holds the
    run's lease lock (and token)."""
    final = layout.step_dir(run_dir, step)
    journal = layout.relay_dir(run_dir, JOURNAL)
    files.atomic_write_json(
        journal, {"step": step, "staged": str(staged), "aside": str(aside), "staged_inode": staged.stat().st_ino}
    )
    fault_point("swap_journaled", step)
    aside.parent.mkdir(parents=True, exist_ok=True)
    if _exchange(staged, final):
        fault_point("swap_exchanged", step)
        staged.rename(aside)
    else:
        final.rename(aside)
        fault_point("swap_original_aside", step)
        staged.rename(final)
    for folder in {run_dir, aside.parent, staged.parent}:
        files.fsync_dir(folder)
    journal.unlink()
    files.fsync_dir(journal.parent)


def recover(run_dir: Path) -> str | None:
    """Finish or undo a swap a killed process left behind (its journal); what was done, in words, or None."""
    journal = layout.relay_dir(run_dir, JOURNAL)
    if not journal.is_file():
        return None
    with Lease(run_dir).locked("finishing an interrupted swap of a step folder"):
        if not journal.is_file():
            return None  # finished by another process meanwhile
        try:
            j = json.loads(journal.read_text())
            step, staged, aside, inode = int(j["step"]), Path(j["staged"]), Path(j["aside"]), int(j["staged_inode"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{journal} cannot be read ({e}): a swap of a step folder was interrupted",
                f"look at {layout.relay_dir(run_dir)} (staging, resharded) and make sure "
                "global_step_N holds a whole checkpoint, then remove the journal",
            ) from None
        relay = layout.relay_dir(run_dir).resolve()
        for p in (staged, aside):  # the journal names folders of this run's .relay/ only
            if relay not in p.resolve().parents:
                raise CheckpointError(f"{journal} names {p}, outside {relay}", "remove the journal: Relay did not write it")
        final = layout.step_dir(run_dir, step)
        if final.exists() and final.stat().st_ino == inode:  # swapped: the original still to be set aside
            if staged.exists():
                aside.parent.mkdir(parents=True, exist_ok=True)
                staged.rename(aside)
            done = f"finished the interrupted swap of step {step}: the original is kept in {aside}"
        elif final.exists():  # the swap had not begun: the original is in place (the staged copy is derived)
            done = f"undid the interrupted swap of step {step}: its original stayed in place"
        elif staged.exists():  # between the fallback's two renames: the original aside, the new one not in
            staged.rename(final)
            done = f"finished the interrupted swap of step {step}: the original is kept in {aside}"
        elif aside.exists():
            aside.rename(final)
            done = f"undid the interrupted swap of step {step}: its original is back in place"
        else:
            raise CheckpointError(
                f"an interrupted swap of step {step} left neither {final}, {staged} nor {aside}",
                "restore the step from S3 (`relay checkpoint restore`) or resume from an earlier one",
            )
        for folder in {run_dir, aside.parent, staged.parent}:
            if folder.is_dir():
                files.fsync_dir(folder)
        journal.unlink()
        return done


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the system or filesystem lacks it."""
    if refused("rename_exchange"):  # the fault suite: a filesystem without it
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # not on this filesystem or kernel
        return False
    raise OSError(err, f"swapping {a} and {b}: {os.strerror(err)}")
