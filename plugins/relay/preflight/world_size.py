"""A run's checkpoint at its spec's world size, before a chunk (checkpoints.on_world_size_change: reshard): the
latest step resharded in place and admitted through the gate. It reads the run's spec, so it sits above
relay.checkpoints, which reshards and validates folders and knows no spec."""

from __future__ import annotations

from relay.checkpoints.reshard import ReshardResult, reshard
from relay.checkpoints.validate import validate_checkpoint
from relay.common.errors import CheckpointError, RelayError
from relay.preflight.admission import admit
from relay.runs import layout
from relay.runs.run import Run


def latest_world_size(run: Run) -> int | None:
    """The world size the run's latest checkpoint was saved at (None: no checkpoint, or it does not say: a broken
    tracker or step is the trainer's to quarantine and fall back from)."""
    try:
        latest = layout.read_tracker(run.dir) if run.dir.is_dir() else None
        return validate_checkpoint(run.dir, latest, upto="structure").world_size if latest else None
    except RelayError:
        return None


def to_spec_world_size(run: Run, want: int | None = None) -> ReshardResult | None:
    """Before a chunk (checkpoints.on_world_size_change: reshard): reshard the run's latest checkpoint in place to
    the spec's world size (or `want`: an elastic spec's, chosen for the chunk's job) and admit it through the gate;
    None when they already agree or there is no checkpoint. An elastic spec's size is chosen at the job's submission
    (relay.ops.elastic), so without `want` it is left alone here."""
    core = run.spec.core_settings
    if want is None and core.world_options:
        return None
    want, fsdp = want or core.world_size, core.fsdp_version
    latest = layout.read_tracker(run.dir) if run.dir.is_dir() else None
    if not latest or want is None:
        return None
    have = validate_checkpoint(run.dir, latest, upto="structure")
    if have.world_size in (None, want):
        return None  # no readable world size: the trainer's own validation says what is wrong
    if fsdp is not None and have.fsdp_version not in (None, fsdp):
        raise CheckpointError(
            f"run {run.name}: step {latest} is FSDP{have.fsdp_version}, the spec asks for FSDP{fsdp}; "
            "a reshard keeps the FSDP version",
            f"set trainer.settings.fsdp_version: {have.fsdp_version} again",
        )
    tp = core.world_size_divisor
    if want % tp:
        raise CheckpointError(
            f"run {run.name}: world size {want} does not divide by the rollout's tensor parallel size "
            f"{tp}, so verl would not run it; step {latest} was not resharded",
            "give a world size that is a multiple of tensor_model_parallel_size",
        )
    result = reshard(run.dir, want, step=latest)
    admission = admit(run, latest)  # as the chunk's validate task admits a step: its smoke check, its fingerprint
    if not admission.ok:
        raise CheckpointError(
            f"run {run.name}: step {latest} resharded to world size {want} failed validation: {admission.explain()}",
            f"the original is kept in {result.original}; move it back to resume at the old world size",
        )
    return result
