"""Frozen training data: at a run's first chunk, each train and val file is fingerprinted and copied,
content-addressed, next to the run (<run_dir>/data/<sha256>.parquet, and S3 …/<run>/data/<sha256>.parquet).
The trainer reads only the frozen copy, verified by hash before each chunk, never the mutable source.

verl restores its dataloader position as an offset into the parquet: rows added, removed or
reordered between chunks make that offset point at other samples, silently. Before every chunk the
source is compared with its frozen fingerprint; the spec's data.on_source_change decides: `fail`
(say what changed) or `use_frozen` (continue on the frozen copy, warn and alert).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from relay.common.files import fsync_dir
from relay.common.timestamps import utc_now
from relay.data.diff import DataDiff, diff
from relay.data.fingerprint import DataError, fingerprint, sha256_file
from relay.runs import layout
from relay.runs.record import read_record, update_record
from relay.runs.run import Run

FROZEN_DIR = "data"


class ObjectStore(Protocol):
    """What freezing asks of the run's store (relay.s3.store.CheckpointStore, a layer above)."""

    def run_key(self, run: str, *parts: str) -> str: ...
    def put_file(self, key: str, path: Path) -> str: ...
    def download_object(self, key_or_uri: str, dest: Path) -> None: ...


@dataclass
class FrozenFile:
    role: str  # train | val
    source: str
    sha256: str
    size: int
    rows: int
    schema: str
    frozen: str  # path relative to the run folder
    uri: str | None = None  # the S3 copy

    def path(self, run_dir: Path) -> Path:
        return Path(run_dir) / self.frozen

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def frozen_files(run_dir: Path) -> list[FrozenFile] | None:
    """The run's frozen data, or None before its first chunk. The record is read back from disk (or S3):
    each entry must name its copy as data/<its sha256>.parquet, so an altered record cannot make a
    verification or a download write or read outside the run folder."""
    data = read_record(run_dir).get("data")
    if not data:
        return None
    where = layout.relay_dir(run_dir, "run.json")
    try:
        files = [FrozenFile(**f) for f in data["files"]]
    except (TypeError, KeyError) as e:
        raise DataError(
            f"the frozen data in {where} is malformed ({e})",
            "restore the run folder's .relay/run.json, or start the run again with fresh_start",
        ) from None
    for f in files:
        if not (
            isinstance(f.sha256, str)
            and re.fullmatch(r"[0-9a-f]{64}", f.sha256)
            and f.frozen == f"{FROZEN_DIR}/{f.sha256}.parquet"
            and f.role in ("train", "val")
        ):
            raise DataError(
                f"{where} names the frozen copy {str(f.frozen)[:80]!r} (sha256 {str(f.sha256)[:80]!r}, "
                f"role {str(f.role)[:20]!r}); Relay only reads {FROZEN_DIR}/<sha256>.parquet in the run "
                "folder",
                "the run record was altered: restore it, or start the run again with fresh_start",
            )
    return files


def freeze(run: Run, store: ObjectStore | None = None, quality: dict[str, Any] | None = None) -> list[FrozenFile]:
    """Fingerprint and copy every data file of the spec into the run (and S3); record it in the run record."""
    run_dir = run.dir
    out = []
    for role, sources in (("train", run.spec.data.train_files), ("val", run.spec.data.val_files)):
        for src in sources:
            fp = fingerprint(src)
            rel = f"{FROZEN_DIR}/{fp.sha256}.parquet"
            dest = run_dir / rel
            if not dest.is_file() or sha256_file(dest)[0] != fp.sha256:
                _copy_verified(Path(src), dest, fp.sha256)
            uri = store.put_file(store.run_key(run.name, rel), dest) if store is not None else None
            out.append(FrozenFile(role, str(src), fp.sha256, fp.size, fp.rows, fp.schema, rel, uri))
    update_record(run_dir, data={"frozen_at": utc_now(), "files": [f.to_dict() for f in out], "quality": quality or {}})
    return out


def _copy_verified(src: Path, dest: Path, sha256: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    shutil.copyfile(src, tmp)
    if sha256_file(tmp)[0] != sha256:
        tmp.unlink()
        raise DataError(f"{src} changed while it was being frozen", "trigger again once the file is stable")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    fsync_dir(dest.parent)


def verify_frozen(run_dir: Path, files: list[FrozenFile], store: ObjectStore | None = None) -> dict[str, list[str]]:
    """Paths of the frozen copies by role, each verified by sha256 (fetched from S3 when missing here)."""
    out: dict[str, list[str]] = {"train": [], "val": []}
    for f in files:
        path = f.path(run_dir)
        if not path.is_file() and store is not None and f.uri:
            store.download_object(f.uri, path)
        if not path.is_file():
            raise DataError(
                f"frozen copy {path} of {f.source} is missing" + (f" (and {f.uri})" if f.uri else ""),
                "restore the run folder, or start the run again with fresh_start",
            )
        got = sha256_file(path)[0]
        if got != f.sha256:
            raise DataError(
                f"frozen copy {path} does not match its sha256 {f.sha256[:12]} (now {got[:12]})",
                "the frozen data was altered; restore it from " + (f.uri or "a backup"),
            )
        out[f.role].append(str(path))
    return out


class SourceDriftError(DataError):
    """A source file changed under a run whose data.on_source_change is fail."""

    def __init__(self, what: str, fix: str | None = None, changes: list[SourceChange] | None = None):
        super().__init__(what, fix)
        self.changes = changes or []


@dataclass
class SourceChange:
    file: FrozenFile
    diff: DataDiff | None  # None: the source file is gone

    def summary(self) -> str:
        if self.diff is None:
            return f"{self.file.role} source {self.file.source} is gone (frozen copy: {self.file.frozen})"
        return f"{self.file.role} source changed since the freeze:\n" + self.diff.summary()


def source_changes(run_dir: Path, files: list[FrozenFile]) -> list[SourceChange]:
    """Source files whose bytes differ from their frozen fingerprint, with what changed."""
    out = []
    for f in files:
        src = Path(f.source)
        if not src.is_file():
            out.append(SourceChange(f, None))
        elif sha256_file(src)[0] != f.sha256:
            out.append(SourceChange(f, diff(f.path(run_dir), src)))
    return out


def check_sources(run: Run) -> list[SourceChange]:
    """Apply the spec's data.on_source_change to the run's sources; return the changes tolerated."""
    files = frozen_files(run.dir)
    if not files:
        return []
    changes = source_changes(run.dir, files)
    if changes and run.spec.data.on_source_change == "fail":
        raise SourceDriftError(
            "the training data changed under run " + run.name + ":\n" + "\n".join(c.summary() for c in changes),
            "restore the source files, or set data.on_source_change: use_frozen to continue on the frozen copy "
            "(a new dataset is a new run: trigger with another run name or fresh_start)",
            changes,
        )
    return changes
