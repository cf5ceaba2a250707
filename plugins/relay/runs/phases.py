"""Phase events: one vocabulary, in events.jsonl, of where a chunk attempt's time goes.

A phase event marks the END of a phase: `{"event": "phase", "phase": <name>, "chunk", "attempt", "time"}`
(time: UTC, as every event). The time a phase took is the gap to the mark before it in the same attempt
(the first one counts from the Ray job's start, which Ray records). Readers (the overhead benchmark, the
run report) take the marks they know and skip the others, so a trainer records the ones it can.

Start-up of a verl chunk, in order (RelayChunkTrainer and the job's driver record them):
  resume_checked     the driver found and validated the resume point, took the lease (Relay)
  trainer_built      verl's TaskRunner actor runs, TransferQueue up, the trainer object built (verl)
  dataloader_ready   verl's dataloaders built (its datasets read and tokenized)
  workers_ready      worker groups placed, actor and reference models built, reward and rollout started
  checkpoint_loaded  verl loaded the resume checkpoint (model, optimizer, data.pt); nothing at step 0
  weights_synced     the rollout holds the actor's weights: verl is ready to train
  first_step_begins  the loop starts its first step (after validation before training, chunk 1 only)
"""

from __future__ import annotations

from pathlib import Path

from relay.runs.metrics import record_event

EVENT = "phase"
STARTUP = ("resume_checked", "trainer_built", "dataloader_ready", "workers_ready", "checkpoint_loaded",
           "weights_synced", "first_step_begins")


def record_phase(run_dir: Path | str, phase: str, *, chunk: int | None, attempt: str | None, **fields) -> dict:
    if phase not in STARTUP:
        raise ValueError(f"unknown phase {phase!r}: one of {', '.join(STARTUP)}")
    return record_event(Path(run_dir), EVENT, phase=phase, chunk=chunk, attempt=attempt, **fields)


def phase_marks(events: list[dict], attempt: str) -> dict[str, str]:
    """{phase: time} of one attempt's phase events (the last mark wins if a phase was recorded twice)."""
    return {e["phase"]: e["time"] for e in events if e.get("event") == EVENT and e.get("attempt") == attempt}
