"""Training runs: which run a trigger continues or starts, the guarded fresh start, and the run record.

A training run is a folder <checkpoint_dir>/<run name> (verl's default_local_dir). Triggering a
spec's DAG with the name of an existing run continues it from its latest valid checkpoint; a fresh
start must be confirmed by typing the run's name, and archives the old folder, never deletes it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from relay import layout
from relay.errors import RunError
from relay.plan import ChunkPlan
from relay.spec import RunSpec, check_run_name
from relay.validate import latest_step_or_problem

RECORD = "run.json"


@dataclass
class RunState:
    run_name: str
    run_dir: str
    latest_step: int  # 0 for a run with no checkpoint yet
    total_steps: int
    next_chunk: int | None  # None when every chunk is done
    archived_to: str | None = None
    problem: str | None = None  # a broken latest checkpoint, which the next chunk's trainer falls back from

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_run_name(spec: RunSpec, requested: str | None) -> str:
    return check_run_name(requested.strip() if requested and requested.strip() else spec.name)


def prepare_run(spec: RunSpec, requested: str | None = None, *, fresh_start: bool = False,
                confirm: str = "", started_by: str = "") -> RunState:
    """Resolve the run, apply a (confirmed) fresh start, and record the run's settings on first use."""
    name = resolve_run_name(spec, requested)
    run_dir = spec.run_dir(name)
    archived = None
    if fresh_start and run_dir.exists() and any(run_dir.iterdir()):
        if confirm != name:
            raise RunError(
                f"fresh start of run {name!r} refused: it already has checkpoints in {run_dir}",
                f"to start it again from step 0, also set confirm_fresh_start to {name!r} (the old folder is "
                f"archived, not deleted); to keep it, trigger without fresh_start, or pick a new run name",
            )
        archived = archive_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = layout.relay_dir(run_dir, RECORD)
    if not record.exists():
        layout.atomic_write_json(record, {
            "version": 1, "run": name, "spec": spec.name, "spec_source": spec.source,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "started_by": started_by,
            "settings_fingerprint": spec.settings_fingerprint(), "resume_critical": spec.resume_critical(),
        })
    return run_state(spec, name, archived)


def read_record(run_dir: Path) -> dict:
    """The run record (.relay/run.json): settings, frozen data, drift decisions. {} before the first trigger."""
    import json

    path = layout.relay_dir(run_dir, RECORD)
    try:
        record = json.loads(path.read_bytes().decode("utf-8", "replace"))
    except FileNotFoundError:
        return {}
    except (ValueError, RecursionError, OSError) as e:
        raise RunError(f"run record {path} cannot be read ({str(e)[:120]})",
                       "restore it from the run's S3 copy (<prefix>/<run>/run.json) or a backup") from None
    if not isinstance(record, dict):
        raise RunError(f"run record {path} holds a JSON {type(record).__name__}, not an object",
                       "restore it from the run's S3 copy (<prefix>/<run>/run.json) or a backup")
    return record


def update_record(run_dir: Path, **fields) -> dict:
    """Set fields of the run record (atomic write; only the Airflow side writes it)."""
    record = {**read_record(run_dir), **fields}
    layout.atomic_write_json(layout.relay_dir(run_dir, RECORD), record)
    return record


def run_state(spec: RunSpec, name: str, archived: Path | None = None) -> RunState:
    run_dir = spec.run_dir(name)
    latest, problem = latest_step_or_problem(run_dir)
    nxt = ChunkPlan.from_spec(spec).next_chunk(latest)
    return RunState(name, str(run_dir), latest or 0, spec.total_steps, nxt.index if nxt else None,
                    str(archived) if archived else None, problem)


def archive_run(run_dir: Path) -> Path:
    """Move a run folder to <checkpoint_dir>/.archive/<run>-<UTC time>; nothing is deleted."""
    dest = run_dir.parent / ".archive" / f"{run_dir.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    run_dir.rename(dest)
    return dest
