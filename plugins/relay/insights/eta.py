"""When a run will end, from its own pace: its ETA against the spec's alerts.deadline.

ETA = now + the steps left × the run's median step time (its last 50 kept steps) + the chunk boundaries left
× the median time a chunk spent outside its steps (the goodput ledger's chunks: wall time less training: the
start-ups, saves, validations, waits). With no step measured yet there is no ETA. The train task checks it
at each chunk's start and end and alerts once per deadline when the ETA is past it (relay.airflow.operators);
Airflow's own deadline alert covers the deadline itself passing while a DAG run is still going.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from relay.common.timestamps import event_time
from relay.insights import goodput
from relay.runs import layout
from relay.runs.metrics import read_jsonl

RECENT_STEPS = 50  # the pace is the recent one: a run speeds up or slows down


@dataclass
class Eta:
    now: float
    at: float  # when the run is expected to end
    steps_left: int
    step_s: float
    chunks_left: int
    boundary_s: float  # a chunk's time outside its steps (0 before a chunk was measured)
    deadline: float | None = None

    @property
    def late_s(self) -> float | None:
        """How far past the deadline the ETA is (negative: early); None without a deadline."""
        return None if self.deadline is None else self.at - self.deadline

    def describe(self) -> str:
        head = (
            f"ETA {event_time(self.at)[:19]}Z: {self.steps_left} step(s) left × {self.step_s:.2f}s + "
            f"{self.chunks_left} chunk boundary(ies) × {self.boundary_s:.1f}s"
        )
        if self.deadline is None:
            return head
        late = self.late_s or 0.0
        return head + (
            f"; {_span(late)} past the deadline {event_time(self.deadline)[:19]}Z"
            if late > 0
            else f"; {_span(-late)} before the deadline {event_time(self.deadline)[:19]}Z"
        )


def eta(
    run_dir: Path,
    *,
    total_steps: int,
    chunk_steps: int,
    latest_step: int,
    deadline: float | None = None,
    now: float | None = None,
) -> Eta | None:
    """The run's ETA once it has a measured step; None before."""
    now = time.time() if now is None else now
    rows = [r for r in read_jsonl(Path(run_dir) / layout.METRICS) if _num(r.get("seconds"))]
    if not rows:
        return None
    step_s = statistics.median(float(r["seconds"]) for r in rows[-RECENT_STEPS:])
    ledger = goodput.ledger(run_dir)
    outside = [c["seconds"] - c["parts"]["training"] for c in (ledger.chunks() if ledger is not None else [])]
    boundary_s = statistics.median(outside) if outside else 0.0
    steps_left = max(0, total_steps - latest_step)
    chunks_left = math.ceil(steps_left / chunk_steps) if chunk_steps > 0 else 0
    return Eta(
        now, now + steps_left * step_s + chunks_left * boundary_s, steps_left, step_s, chunks_left, boundary_s, deadline
    )


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _span(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
