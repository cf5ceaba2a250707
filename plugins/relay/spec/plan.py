"""ChunkPlan: global steps 1..total cut into chunks; chunk k always ends at the same global step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relay.spec.run_spec import RunSpec


@dataclass(frozen=True)
class Chunk:
    """One chunk of a run: its index among `count`, and the steps it trains, first_step..end_step."""

    index: int  # 1-based
    first_step: int
    end_step: int  # inclusive; the chunk saves a checkpoint here
    count: int  # chunks in the plan

    @property
    def task_group_id(self) -> str:
        """The chunk's Airflow task group: chunk_01, chunk_02, ..."""
        return f"chunk_{self.index:02d}"

    @property
    def steps(self) -> int:
        """How many steps it trains."""
        return self.end_step - self.first_step + 1

    def done_by(self, latest_step: int | None) -> bool:
        """A chunk is done once the latest valid checkpoint has reached its end step."""
        return latest_step is not None and latest_step >= self.end_step

    def __str__(self) -> str:
        """The chunk in a log's words: chunk K/N (steps A..B)."""
        return f"chunk {self.index}/{self.count} (steps {self.first_step}..{self.end_step})"


@dataclass(frozen=True)
class ChunkPlan:
    """A run's steps cut into chunks of chunk_steps (the last one shorter when they do not divide)."""

    total_steps: int
    chunk_steps: int

    def __post_init__(self) -> None:
        """Refuse a plan that cannot be cut: no steps, or a chunk of no steps."""
        if self.total_steps <= 0 or self.chunk_steps <= 0:
            raise ValueError("total_steps and chunk_steps must be positive")

    @classmethod
    def from_spec(cls, spec: RunSpec) -> ChunkPlan:
        """The plan of a spec's total_steps and chunk_steps."""
        return cls(spec.total_steps, spec.chunk_steps)

    @property
    def chunks(self) -> list[Chunk]:
        """Every chunk, in order."""
        n = -(-self.total_steps // self.chunk_steps)
        return [
            Chunk(k, (k - 1) * self.chunk_steps + 1, min(k * self.chunk_steps, self.total_steps), n) for k in range(1, n + 1)
        ]

    def chunk(self, index: int) -> Chunk:
        """The chunk with this 1-based index."""
        return self.chunks[index - 1]

    def chunk_for_step(self, step: int) -> Chunk:
        """The chunk that trains `step`."""
        if not 1 <= step <= self.total_steps:
            raise ValueError(f"step {step} is outside 1..{self.total_steps}")
        return self.chunks[(step - 1) // self.chunk_steps]

    def next_chunk(self, latest_step: int | None) -> Chunk | None:
        """The first chunk not yet done, or None when the run is complete."""
        return next((c for c in self.chunks if not c.done_by(latest_step)), None)

    def describe(self, latest_step: int | None = None) -> str:
        """The plan as `relay plan` prints it, each chunk marked done or to do against `latest_step`."""
        lines = [f"{self.total_steps} steps in {len(self.chunks)} chunks of up to {self.chunk_steps}"]
        for c in self.chunks:
            state = "done" if c.done_by(latest_step) else "to do"
            lines.append(f"  {c.task_group_id}: steps {c.first_step:>6}..{c.end_step:<6} {state}")
        return "\n".join(lines)
