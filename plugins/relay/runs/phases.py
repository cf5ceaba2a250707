"""Phase events: one vocabulary, in events.jsonl, of where a chunk attempt's time goes.

A phase event marks the END of a phase: `{"event": "phase", "phase": <name>, "chunk", "attempt", "time"}`
(time: UTC to the millisecond, as every event; a mark of a time Ray recorded carries Ray's). The time a phase
took is the gap to the mark before it in the same attempt. Readers (the goodput ledger, the overhead
benchmarks, the run report) take the marks they know and skip the others, so each writer records the ones it
can: a chunk run by `relay train` has no Airflow marks.

Around the trainer, the chunk's Airflow train task records (relay.airflow.operators; `relay train` records the
two job marks of its own Ray job):
  task_started       the train task's try began to run (Airflow scheduled it): the end of the scheduling gap
  job_submitted      Relay's checks passed and the Ray job was submitted
  job_started        Ray started the job's driver (Ray's own time)
  job_ended          the job's driver ended (Ray's own time)
  task_done          the train task's try ended (Airflow noticed the job's end and ran execute_complete)

Start-up of a verl chunk, in order (RelayChunkTrainer and the job's driver record them):
  resume_checked     the driver found and validated the resume point, took the lease (Relay)
  trainer_built      verl's TaskRunner actor runs, TransferQueue up, the trainer object built (verl)
  dataloader_ready   verl's dataloaders built (its datasets read and tokenized)
  workers_ready      worker groups placed, actor and reference models built, reward and rollout started
  checkpoint_loaded  verl loaded the resume checkpoint (model, optimizer, data.pt); nothing at step 0
  weights_synced     the rollout holds the actor's weights: verl is ready to train
  first_step_begins  the loop starts its first step (after validation before training, chunk 1 only)

The other events the ledger reads carry their own duration (`seconds`): `checkpoint` (a save and its commit),
`validation` (the gate), `publish` (an upload to S3); and every metrics.jsonl row (a step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from relay.common.timestamps import event_time
from relay.runs.folder import RunFolder
from relay.runs.metrics import record_event

EVENT = "phase"
ORCHESTRATION = ("task_started", "job_submitted", "job_started", "job_ended", "task_done")
STARTUP = (
    "resume_checked",
    "trainer_built",
    "dataloader_ready",
    "workers_ready",
    "checkpoint_loaded",
    "weights_synced",
    "first_step_begins",
)
VOCABULARY = ORCHESTRATION + STARTUP


class JobTimes(Protocol):
    """What record_job_times reads of a Ray job's state (relay.jobs.ray_jobs.JobState, a layer above)."""

    @property
    def submission_id(self) -> str: ...
    @property
    def start_time(self) -> float | None: ...
    @property
    def end_time(self) -> float | None: ...


def record_phase(
    run: Path | str | RunFolder,
    phase: str,
    *,
    chunk: int | None,
    attempt: str | None,
    at: float | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The end of `phase`, now or at epoch seconds `at` (a time another system recorded, such as Ray's). Into a
    RunFolder: fenced by its incarnation (refused once the run was started again)."""
    if phase not in VOCABULARY:
        raise ValueError(f"unknown phase {phase!r}: one of {', '.join(VOCABULARY)}")
    if at is not None:
        fields["time"] = event_time(at)
    if isinstance(run, RunFolder):
        return run.record(EVENT, phase=phase, chunk=chunk, attempt=attempt, **fields)
    return record_event(Path(run), EVENT, phase=phase, chunk=chunk, attempt=attempt, **fields)


def phase_marks(events: list[dict[str, Any]], attempt: str, phases: tuple[str, ...] = STARTUP) -> dict[str, str]:
    """{phase: time} of one attempt's marks among `phases` (the last mark wins if a phase was recorded twice)."""
    return {
        e["phase"]: e["time"]
        for e in events
        if e.get("event") == EVENT and e.get("attempt") == attempt and e.get("phase") in phases
    }


def record_job_times(run_dir: Path | str, job: JobTimes | None, *, chunk: int | None) -> None:
    """`job_started` and `job_ended` of a Ray job (relay.jobs.ray_jobs.JobState), at Ray's own times."""
    if job is None:
        return
    if job.start_time:
        record_phase(run_dir, "job_started", chunk=chunk, attempt=job.submission_id, at=job.start_time)
    if job.end_time:
        record_phase(run_dir, "job_ended", chunk=chunk, attempt=job.submission_id, at=job.end_time)
