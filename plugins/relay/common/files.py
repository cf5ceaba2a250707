"""Files written so that a reader never sees half of one, and relative paths that stay inside their folder.

atomic_write: a temp file beside the target, fsync, rename, fsync the folder (the tracker, records, manifests,
every small versioned file Relay keeps). check_relpath: a name read back from disk or S3 (a manifest's file, a
record's frozen data file, a part of an S3 key) that must never reach outside the folder it is joined to.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import cast

from relay.common.errors import CheckpointError


def atomic_write(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: object) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under root, so a rename of root publishes durable bytes."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def relpath_problem(rel: object) -> str | None:
    """Why `rel` is not a plain relative path inside a folder (a checkpoint file named by a manifest, a
    frozen data file named by a run record, a part of an S3 key), or None. Such names are read back from
    disk and S3, so they must never reach outside the folder or the prefix they are joined to."""
    if not isinstance(rel, str) or not rel:
        return "it is empty or not a string"
    if len(rel) > 1024:
        return "it is longer than 1024 characters"
    if rel.startswith("/"):
        return "it is absolute"
    if any(c == "\\" or ord(c) < 32 or ord(c) == 127 for c in rel):
        return "it holds a backslash or a control character"
    if any(p in ("", ".", "..") for p in rel.split("/")):
        return "it has an empty, '.' or '..' part"
    return None


def check_relpath(rel: object, what: str) -> str:
    """`rel` if it is a plain relative path (see relpath_problem), else a CheckpointError naming `what`."""
    if problem := relpath_problem(rel):
        raise CheckpointError(
            f"{what} names the path {rel!r}, which Relay refuses: {problem}",
            "it was altered or written by something else than Relay; do not use it, validate "
            "and publish the checkpoint again",
        )
    return cast(str, rel)  # relpath_problem found none: a non-empty str
