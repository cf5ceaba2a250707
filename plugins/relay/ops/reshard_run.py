"""A run's latest checkpoint taken to its world size before a chunk (checkpoints.on_world_size_change: reshard): the
spec's (a person changed nnodes or n_gpus_per_node), or the one an elastic run's chunk was given (relay.ops.elastic).
The step is resharded in place (the original kept), admitted through the gate and republished, as the DAG's reshard
task, its train task and `relay train` each do it.
"""

from __future__ import annotations

from dataclasses import dataclass

from relay.checkpoints.reshard import ReshardResult
from relay.common.errors import StoreError
from relay.preflight.world_size import to_spec_world_size
from relay.runs.run import Run
from relay.s3.store import CheckpointStore


@dataclass
class Resharded:
    """The run's latest checkpoint taken to the spec's world size: what was done, and a warning when S3's copy
    could not be replaced."""

    done: str
    result: ReshardResult
    warning: str | None = None


def reshard_to_spec(
    run: Run, store: CheckpointStore | None, *, publish_or_fail: bool = False, world_size: int | None = None
) -> Resharded | None:
    """checkpoints.on_world_size_change: reshard, before each chunk: the latest checkpoint taken to the spec's world
    size (or `world_size`, an elastic spec's for the chunk's job; the original kept) and admitted, and S3's copy
    replaced by it. None when nothing was resharded. S3 down: the DAG's task fails (`publish_or_fail`); `relay
    train` warns and trains on (the chunk's saves publish again)."""
    if run.spec.checkpoints.on_world_size_change != "reshard":
        return None
    result = to_spec_world_size(run, world_size)
    if result is None:
        return None
    out = Resharded(f"run {run.name}: {result.explain()}", result)
    if store is not None and run.spec.s3 is not None:
        try:
            store.publish(run.folder, result.step)
        except StoreError as e:  # the local step is resharded and valid; the chunk's own saves publish again
            if publish_or_fail:
                raise
            out.warning = (
                f"S3's copy of step {result.step} is still the world-size-{result.from_world_size} one: {e}; "
                f"publish it when S3 answers: relay checkpoint publish {run.dir} {run.spec.s3.uri} --step {result.step}"
            )
    return out
