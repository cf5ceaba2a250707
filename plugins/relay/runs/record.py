"""The run record: `<run>/.relay/run.json`, the small versioned file that says which run a folder holds.

It names the run and its incarnation, and keeps the run's settings snapshot, frozen data and drift
decisions (written by guard and data.freeze). An incarnation is one life of a run name: a fresh start
begins a new one, and every checkpoint's manifest and every published object carries the
incarnation it was written by, so that a restore never takes another life's checkpoints. Records
written before incarnations existed (version 1) are incarnation "1".
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any, TypeGuard

from relay.common import files
from relay.common.errors import RunError
from relay.common.timestamps import utc_stamp
from relay.runs import layout

RECORD = "run.json"
VERSION = 2  # 2: incarnation
LEGACY_INCARNATION = "1"  # a record, manifest or publication from before incarnations
INCARNATION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9:._+-]{0,63}")  # only ever compared and shown, never a path


def is_incarnation(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and INCARNATION_PATTERN.fullmatch(value) is not None


def new_incarnation() -> str:
    """A new incarnation id: when it began, and enough randomness that two hosts never pick the same one."""
    return f"{utc_stamp()}-{secrets.token_hex(4)}"


def read_record(run_dir: Path) -> dict[str, Any]:
    """The run record (.relay/run.json): settings, frozen data, drift decisions. {} before the first trigger."""
    path = layout.relay_dir(run_dir, RECORD)
    try:
        record = json.loads(path.read_bytes().decode("utf-8", "replace"))
    except FileNotFoundError:
        return {}
    except (ValueError, RecursionError, OSError) as e:
        raise RunError(
            f"run record {path} cannot be read ({str(e)[:120]})",
            "restore it from the run's S3 copy (<prefix>/<run>/run.json) or a backup",
        ) from None
    if not isinstance(record, dict):
        raise RunError(
            f"run record {path} holds a JSON {type(record).__name__}, not an object",
            "restore it from the run's S3 copy (<prefix>/<run>/run.json) or a backup",
        )
    return record


def write_record(run_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    files.atomic_write_json(layout.relay_dir(run_dir, RECORD), record)
    return record


def update_record(run_dir: Path, **fields: Any) -> dict[str, Any]:
    """Set fields of the run record (atomic write; only the Airflow side writes it)."""
    return write_record(run_dir, {**read_record(run_dir), **fields})


def incarnation_of(record: dict[str, Any]) -> str | None:
    """The incarnation a record names; None for no record at all ({}), "1" for a record from before them."""
    if not record:
        return None
    value = record.get("incarnation", LEGACY_INCARNATION)
    if not is_incarnation(value):
        raise RunError(
            f"run record of run {record.get('run')!r} names the incarnation {str(value)[:40]!r}",
            "restore the record from the run's S3 copy (<prefix>/<run>/run.json) or a backup",
        )
    return value


def folder_incarnation(run_dir: Path) -> str | None:
    """The incarnation of the run a folder holds (None: the folder holds no run record)."""
    return incarnation_of(read_record(run_dir))
