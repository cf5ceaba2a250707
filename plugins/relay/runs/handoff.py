"""A warm handoff: what a chunk's job that went on into the next chunk and that chunk's train task tell each
other, as small files in the run folder (`.relay/handoff/`), so that neither needs the other's process.

    chunk_NN.warm.json       the job went on warm into chunk NN (written by the job after committing chunk NN-1's
                             end step): its attempt, the step it went on from, its lease token, its spec's digest
    chunk_NN.admission.json  chunk NN's train task's answer to that attempt: admitted (its checks passed; the task
                             takes over the job and its lease token) or refused (why)

The job commits nothing of chunk NN before an admission of its own attempt; a refusal, or none within
`chunks.admission_timeout_minutes`, stops it without committing (relay.trainers.session). An answer names the
attempt it answers, so an answer left from an earlier DAG run never admits or stops a later job.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from relay.common import files
from relay.common.timestamps import utc_now
from relay.runs import layout

FOLDER = "handoff"


def _path(run_dir: Path, chunk: int, what: str) -> Path:
    return layout.relay_dir(run_dir, FOLDER, f"chunk_{chunk:02d}.{what}.json")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    files.atomic_write(path, json.dumps({**record, "time": utc_now()}, sort_keys=True).encode())


def spec_digest(spec_json: str) -> str:
    """What decides that a chunk may start warm: the spec the job runs is the one the chunk's task loaded."""
    return hashlib.sha256(spec_json.encode()).hexdigest()


MIN_ADMISSION_S = 300.0  # a warm job waits at least this long for its admission (a DAG run's checks take a while)


def admission_limit_s(minutes: float | None, chunk_seconds: float | None) -> float:
    """How long a warm job may go unadmitted: chunks.admission_timeout_minutes where the spec sets it, else twice the
    measured duration of the chunk it went on from (the run's own pace), at least MIN_ADMISSION_S."""
    if minutes is not None:
        return minutes * 60
    return max(MIN_ADMISSION_S, 2 * (chunk_seconds or 0))


def went_warm(
    run_dir: Path, chunk: int, *, attempt: str, from_step: int, token: int, spec: str, chunk_seconds: float | None = None
) -> None:
    """The job `attempt` goes on into `chunk` from its committed step `from_step` (an earlier answer is removed);
    `chunk_seconds`: how long the chunk it went on from took (what the admission limit follows)."""
    _path(run_dir, chunk, "admission").unlink(missing_ok=True)
    _write(
        _path(run_dir, chunk, "warm"),
        {
            "chunk": chunk,
            "attempt": attempt,
            "from_step": from_step,
            "token": token,
            "spec": spec,
            "chunk_seconds": chunk_seconds,
        },
    )


def warm(run_dir: Path, chunk: int) -> dict[str, Any] | None:
    """The record of the job that went on warm into `chunk`, if one did."""
    return _read(_path(run_dir, chunk, "warm"))


def went_on(run_dir: Path | str, chunk: int, attempt: str) -> bool:
    """Did job `attempt` go on warm into `chunk` (its previous chunk's end is committed)?"""
    record = warm(Path(run_dir), chunk)
    return record is not None and record.get("attempt") == attempt


def admit(run_dir: Path, chunk: int, *, attempt: str, token: int, by: str) -> None:
    _write(
        _path(run_dir, chunk, "admission"), {"chunk": chunk, "attempt": attempt, "admitted": True, "token": token, "by": by}
    )


def refuse(run_dir: Path, chunk: int, why: str) -> str | None:
    """Refuse the job that went on warm into `chunk` (it stops without committing): its attempt, or None if none did."""
    record = warm(run_dir, chunk)
    if record is None:
        return None
    attempt = str(record.get("attempt"))
    _write(_path(run_dir, chunk, "admission"), {"chunk": chunk, "attempt": attempt, "admitted": False, "why": why})
    return attempt


def refuse_unless_admitted(run_dir: Path, chunk: int, attempt: str, why: str) -> bool:
    """Refuse job `attempt`'s warm chunk unless its train task admitted it already (then the task follows it): whether
    it was refused."""
    got = answer(run_dir, chunk, attempt)
    if (got is not None and got.get("admitted")) or not went_on(run_dir, chunk, attempt):
        return False
    return refuse(run_dir, chunk, why) == attempt


def answer(run_dir: Path, chunk: int, attempt: str) -> dict[str, Any] | None:
    """Chunk `chunk`'s answer to job `attempt`: {"admitted": True, "token", "by"} or {"admitted": False, "why"}."""
    record = _read(_path(run_dir, chunk, "admission"))
    return record if record is not None and record.get("attempt") == attempt else None
