"""Supervised mode (verl_ppo, `trainer.settings.mode: supervised`): one long verl job for the whole
run, saving every chunk_steps; the chunk tasks only wait for each checkpoint, validate and publish it.

    preflight.run >> preflight.settings >> preflight.data >> supervise (one Ray job: steps 1..total)
    preflight.data >> chunk_01.validate >> chunk_02.validate >> ... >> chunk_NN.validate >> finish
    chunk_k.validate >> chunk_k.publish >> chunk_k+1.publish;   supervise >> finish

`supervise` is the chunk operator seeing the whole run as its one chunk: it submits the job, follows
it (progress, stall, deadline = chunk_timeout_minutes x chunks), and fails when the job fails, so
Airflow's retry resubmits it, resuming from the latest valid checkpoint as any chunk does. The
job pays verl's start-up (model load, rollout engine warm-up) once, not once per chunk.

`chunk_k.validate` waits (deferred) until the tracker reaches step k x chunk_steps, then runs the
gate on that step. The job trains on meanwhile, so the tracker may already be past the step: the
gate checks the step's folder, not that the tracker names it.
"""

from __future__ import annotations

from relay.airflow.operators import RayChunkOperator, ValidateCheckpointOperator
from relay.ops import runs
from relay.ops.runs import Run

SUPERVISE_TASK = "supervise"


def is_supervised(spec) -> bool:
    return spec.core_settings.supervised


class SupervisedRunOperator(RayChunkOperator):
    """The whole run as one Ray job; a retry resubmits it, resuming from the latest valid checkpoint."""

    ui_color = "#d2e3fc"

    def __init__(self, **kwargs):
        kwargs.setdefault("chunk_index", 1)
        super().__init__(**kwargs)

    def _run(self, context) -> Run:
        run = super()._run(context)
        return runs.whole_run(run)


class SupervisedValidateOperator(ValidateCheckpointOperator):
    """Wait for step k x chunk_steps's checkpoint of the one long job, then the gate on that step."""

    tracker_at_end_step = False


def supervise_task(spec, **kwargs) -> SupervisedRunOperator:
    """The one long job's task (create it inside the DAG's context)."""
    return SupervisedRunOperator(
        task_id=SUPERVISE_TASK,
        spec_path=spec.source,
        doc_md=f"Train all {spec.total_steps} steps as one Ray job (verl saves every "
        f"{spec.chunk_steps}); a retry resubmits it, resuming from the latest "
        "valid checkpoint.",
        **kwargs,
    )


def validate_task(spec, chunk) -> SupervisedValidateOperator:
    """chunk_k.validate of a supervised run (create it inside the chunk's task group)."""
    return SupervisedValidateOperator(
        task_id="validate",
        spec_path=spec.source,
        chunk_index=chunk.index,
        train_task=None,
        doc_md=f"Wait for step {chunk.end_step}'s checkpoint of the supervised job; validate it; quarantine it if "
        "it is not whole.",
    )
