"""ChunkPlan: global steps 1..total cut into chunks; chunk k always ends at the same global step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relay.spec.run_spec import RunSpec


@dataclass(frozen=True)
class Chunk:
    index: int  # 1-based
    first_step: int
    end_step: int  # inclusive; the chunk saves a checkpoint here
    count: int  # chunks in the plan

    @property
    def task_group_id(self) -> str:
        return f"chunk_{self.index:02d}"

    @property
    def steps(self) -> int:
        return self.end_step - self.first_step + 1

    def done_by(self, latest_step: int | None) -> bool:
        """A chunk is done once the latest valid checkpoint has reached its end step."""
        return latest_step is not None and latest_step >= self.end_step

    def __str__(self) -> str:
        return f"chunk {self.index}/{self.count} (steps {self.first_step}..{self.end_step})"


@dataclass(frozen=True)
class ChunkPlan:
    total_steps: int
    chunk_steps: int

    def __post_init__(self) -> None:
        if self.total_steps <= 0 or self.chunk_steps <= 0:
            raise ValueError("total_steps and chunk_steps must be positive")

    @classmethod
    def from_spec(cls, spec: RunSpec) -> ChunkPlan:
        return cls(spec.total_steps, spec.chunk_steps)

    @property
    def chunks(self) -> list[Chunk]:
        n = -(-self.total_steps // self.chunk_steps)
        return [
            Chunk(k, (k - 1) * self.chunk_steps + 1, min(k * self.chunk_steps, self.total_steps), n) for k in range(1, n + 1)
        ]

    def chunk(self, index: int) -> Chunk:
        return self.chunks[index - 1]

    def chunk_for_step(self, step: int) -> Chunk:
        if not 1 <= step <= self.total_steps:
            raise ValueError(f"step {step} is outside 1..{self.total_steps}")
        return self.chunks[(step - 1) // self.chunk_steps]

    def next_chunk(self, latest_step: int | None) -> Chunk | None:
        """The first chunk not yet done, or None when the run is complete."""
        return next((c for c in self.chunks if not c.done_by(latest_step)), None)

    def describe(self, latest_step: int | None = None) -> str:
        lines = [f"{self.total_steps} steps in {len(self.chunks)} chunks of up to {self.chunk_steps}"]
        for c in self.chunks:
            state = "done" if c.done_by(latest_step) else "to do"
            lines.append(f"  {c.task_group_id}: steps {c.first_step:>6}..{c.end_step:<6} {state}")
        return "\n".join(lines)
