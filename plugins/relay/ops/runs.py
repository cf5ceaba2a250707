"""Which training run a front-end means: the spec loaded and dated with a DAG run's logical date, and the run
a trigger, a form or a command names in it (resolved the same way everywhere: the trigger form's note, the
preflight task, an alert sent before preflight ran).

The run's value types (`Run`, `RunSpec`, `ChunkPlan`, `Chunk`) are what the operations take and return; the
front-ends name them from here.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from relay.preflight.prepare import resolve_run_name
from relay.runs.run import Run
from relay.spec.kinds import KINDS
from relay.spec.plan import Chunk, ChunkPlan
from relay.spec.run_spec import (
    RunSpec,
    check_spec_environment,
    dated,
    dated_run_name,
    deadline_seconds,
    load_spec,
    spec_for_dag,
)

__all__ = [
    "Chunk",
    "ChunkPlan",
    "Run",
    "RunSpec",
    "asked_run_name",
    "chunk_of",
    "deadline_at",
    "run_named",
    "run_to_start",
    "spec_at",
    "spec_for_dag",
    "whole_run",
]


def spec_at(spec_path: str | Path, when: datetime | None = None, *, check_environment: bool = False) -> RunSpec:
    """The spec at `spec_path` as the DAG run of logical date `when` reads it (its data paths' dates filled in);
    `check_environment`: also the environment variables it names, where a run is about to start."""
    spec = load_spec(spec_path, check_environment=False)
    if when is not None:
        spec = dated(spec, when)
    if check_environment:
        check_spec_environment(spec)
    return spec


def run_named(spec_path: str | Path, name: str | None, incarnation: str | None = None, when: datetime | None = None) -> Run:
    """Run `name` of the spec (the spec's own run where None), dated with `when`, in `incarnation` where known."""
    return Run.of(spec_at(spec_path, when), name, incarnation)


def asked_run_name(spec: RunSpec, asked: object, when: datetime | None) -> str:
    """The run a trigger asks for: its `run` (checked as a run name), else, for a scheduled spec, the run of the
    logical date (now where a manual trigger has none), else the spec's own run."""
    if (isinstance(asked, str) and asked.strip()) or not spec.airflow.schedule:
        return resolve_run_name(spec, asked if isinstance(asked, str) else None)
    return resolve_run_name(spec, dated_run_name(spec, when or datetime.now(UTC)))


def run_to_start(spec_path: str | Path, asked: object, when: datetime | None) -> Run:
    """The run a DAG run of logical date `when` trains (`asked`: its `run` Param), its spec's environment checked."""
    spec = spec_at(spec_path, when, check_environment=True)
    return Run.of(spec, asked_run_name(spec, asked, when))


def chunk_of(spec_path: str | Path, index: int) -> Chunk:
    """Chunk `index` (from 0) of the spec's plan."""
    return ChunkPlan.from_spec(spec_at(spec_path)).chunk(index)


def deadline_at(spec: RunSpec) -> datetime | None:
    """When the run should be done (alerts.deadline, a time or a duration from now), in UTC; None without one."""
    seconds = deadline_seconds(spec.alerts.deadline, spec.source, "alerts.deadline")
    return datetime.fromtimestamp(seconds, UTC) if seconds else None


def whole_run(run: Run) -> Run:
    """The run as one job trains it whole (supervised: the trainer kind's settings for every step at once)."""
    return Run.of(KINDS[run.spec.trainer.kind].whole_run_view(run.spec), run.name, run.incarnation)
