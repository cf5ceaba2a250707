"""The trainer contract, shared by every trainer kind: resume from the latest valid checkpoint,
train until step E, save a checkpoint at E in verl's layout, exit 0.

A ChunkRequest travels to a Ray job as JSON in one environment variable; the job's entrypoint
(relay.trainers.job) and the in-process CLI (`relay train`) both end in run_chunk().
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path

from relay.runs.run import Run
from relay.spec.kinds import KINDS
from relay.spec.run_spec import RunSpec, spec_from_json

ENV_VAR = "RELAY_CHUNK_REQUEST"


@dataclass
class ChunkRequest:
    """What a chunk's trainer is asked: train `run` to `to_step`, resuming from its latest valid checkpoint."""

    run: Run  # its incarnation: only that life's checkpoints are restored (relay.runs.record)
    to_step: int
    chunk: int | None = None  # chunk index, for logs and metrics
    attempt: str = "local"  # who is training: a Ray submission id, or local:<host>:<pid>
    lease_token: int | None = None  # None: take the lease in this process (the CLI)
    restore: bool = True  # with no valid local checkpoint, restore the newest published one (spec.s3)
    # A DAG's job: with warm chunks, go on into the next chunk, whose train task admits it. Never `relay train`'s:
    # nothing would admit its next chunk.
    handoff: bool = False
    # An elastic spec's world size for this job and its nodes, chosen at its submission from what the cluster holds
    # (relay.ops.elastic); None: the spec's own.
    world_size: int | None = None
    nnodes: int | None = None

    @property
    def spec(self) -> RunSpec:
        """The run's spec."""
        return self.run.spec

    @property
    def run_dir(self) -> Path:
        """The run's folder: its checkpoints, metrics and events."""
        return self.run.dir

    def to_json(self) -> str:
        """The request as one JSON string, the way it travels to a Ray job (ENV_VAR)."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "run"}
        return json.dumps(
            {"spec": json.loads(self.spec.to_json()), "run_name": self.run.name, "incarnation": self.run.incarnation, **d}
        )

    @classmethod
    def from_json(cls, blob: str) -> ChunkRequest:
        """The request from its JSON string."""
        d = json.loads(blob)
        spec = spec_from_json(json.dumps(d.pop("spec")))
        return cls(run=Run.of(spec, d.pop("run_name"), d.pop("incarnation")), **d)

    @classmethod
    def from_env(cls) -> ChunkRequest:
        """The request a Ray job was given, from its environment (ENV_VAR)."""
        return cls.from_json(os.environ[ENV_VAR])


@dataclass
class ChunkResult:
    """What a chunk's trainer did: the step it resumed from, the step it ended at, and the checkpoint it saved last."""

    run_name: str
    resumed_from: int  # 0 for a fresh start
    end_step: int
    steps_trained: int
    seconds: float
    checkpoint: str


def run_chunk(req: ChunkRequest) -> ChunkResult:
    """Dispatch a chunk to its trainer kind."""

    return KINDS[req.spec.trainer.kind].chunk_function()(req)
