"""A save interval that fits the run: Young–Daly, from what the run measured.

- C, a save's cost: the save and its commit (each `checkpoint` event's seconds), and at a chunk's end the
  validation that holds the next chunk back (each `validation` event's seconds), averaged over the saves the
  spec makes (save_freq within a chunk, and every chunk's end);
- R, a restart's cost: a trainer's start-up, from its process's start (`chunk_start`'s process_started) to the
  start of its first step;
- MTBF: the run's wall time over its interruptions (attempts that failed, were killed or stopped early), or the
  spec's checkpoints.mtbf_hours when the run has seen none (or always, when it is set).

With a save every τ seconds of training, the first-order cost per second is C/τ for saving plus (τ/2 + R)/MTBF
for the work a failure loses and the restart after it; it is least at Young's τ* = √(2·C·MTBF). The interval
counts training time only (the steps), as the run's median step gives it. Nothing changes automatically:
`relay doctor` and the run report say what to set, and with how few failures the MTBF was observed (fewer than 3:
a rough figure).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from relay.insights import goodput
from relay.runs import layout
from relay.runs.metrics import read_events, read_jsonl

FEW_FAILURES = 3  # an MTBF observed from fewer failures than this is flagged as rough


@dataclass
class SaveInterval:
    step_s: float  # the run's median step time
    save_s: float  # a save and its commit (median)
    validation_s: float  # the gate at a chunk's end (median; 0 when none was recorded)
    restart_s: float | None  # a trainer's start-up (median); None when not measured
    mtbf_s: float | None
    failures: int  # interruptions behind an observed MTBF (0: the spec's mtbf_hours, or unknown)
    mtbf_source: str  # "observed", "spec" or "unknown"
    saves_per_chunk: int  # what the spec makes: save_freq within a chunk, and the chunk's end
    chunk_steps: int
    total_steps: int | None = None  # the run's: an interval beyond it means one chunk for the whole run

    @property
    def interval_steps(self) -> float:
        return self.chunk_steps / self.saves_per_chunk

    @property
    def cost_s(self) -> float:
        """C: a save's cost averaged over a chunk's saves (only the chunk's end is validated)."""
        return self.save_s + self.validation_s / self.saves_per_chunk

    @property
    def young_daly_s(self) -> float | None:
        """τ* = √(2·C·MTBF), in seconds of training."""
        return math.sqrt(2 * self.cost_s * self.mtbf_s) if self.mtbf_s else None

    @property
    def young_daly_steps(self) -> float | None:
        return self.young_daly_s / self.step_s if self.young_daly_s and self.step_s > 0 else None

    def overhead(self, interval_s: float) -> float | None:
        """The expected share of time lost at a save every interval_s: C/τ + (τ/2 + R)/MTBF."""
        if not self.mtbf_s or interval_s <= 0:
            return None
        return self.cost_s / interval_s + (interval_s / 2 + (self.restart_s or 0)) / self.mtbf_s

    def advice(self) -> str:
        """What to set, with the numbers (one paragraph)."""
        now_s = self.interval_steps * self.step_s
        head = (
            f"a save costs C = {self.cost_s:.2f}s (save and commit {self.save_s:.2f}s, validation "
            f"{self.validation_s:.2f}s at each chunk's end, {self.saves_per_chunk} save(s) per chunk), a restart "
            f"R = {_s(self.restart_s)}, a step {self.step_s:.3f}s"
        )
        if not self.mtbf_s:
            return (
                f"{head}; no failure yet and no checkpoints.mtbf_hours in the spec: set it to the cluster's "
                "MTBF to get a save interval"
            )
        rough = f" from {self.failures} failure(s), a rough figure" if 0 < self.failures < FEW_FAILURES else ""
        seen = f"observed{rough}" if self.mtbf_source == "observed" else "checkpoints.mtbf_hours"
        best_s, best_steps = self.young_daly_s or 0.0, self.young_daly_steps or 0.0
        now, best = self.overhead(now_s), self.overhead(best_s)
        if best_steps < self.chunk_steps:
            setting = f"trainer.settings.save_freq: {max(1, round(best_steps))}"
        elif self.total_steps and best_steps >= self.total_steps:
            setting = (
                f"chunk_steps: {self.total_steps}, the whole run of {self.total_steps} steps in one chunk "
                "(and save_freq 0: one save, at its end)"
            )
        else:
            setting = f"chunk_steps: {max(1, round(best_steps))} (and save_freq 0: one save per chunk)"
        return (
            f"{head}; MTBF {_s(self.mtbf_s)} ({seen}) -> Young–Daly: save every √(2·C·MTBF) = {best_s:.0f}s of "
            f"training = {best_steps:.0f} steps. Now every {self.interval_steps:.0f} steps ({now_s:.0f}s): expected "
            f"overhead {now:.1%}; at {best_steps:.0f} steps {best:.1%}. To change it: {setting}"
        )

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "cost_s": self.cost_s,
            "young_daly_s": self.young_daly_s,
            "young_daly_steps": self.young_daly_steps,
            "overhead_now": self.overhead(self.interval_steps * self.step_s),
            "overhead_at_young_daly": self.overhead(self.young_daly_s or 0.0),
        }


def save_interval(
    run_dir: Path, *, chunk_steps: int, save_freq: int = 0, mtbf_hours: float | None = None, total_steps: int | None = None
) -> SaveInterval | None:
    """The run's measured costs and the Young–Daly interval; None before a step and a save were recorded."""
    run_dir = Path(run_dir)
    rows = [r for r in read_jsonl(run_dir / layout.METRICS) if isinstance(r.get("seconds"), (int, float))]
    events = read_events(run_dir)
    saves = [float(e["seconds"]) for e in events if e.get("event") == "checkpoint" and _num(e.get("seconds"))]
    if not rows or not saves:
        return None
    checks = [float(e["seconds"]) for e in events if e.get("event") == "validation" and _num(e.get("seconds"))]
    run = goodput.ledger(run_dir)  # the MTBF: the ledger's wall time over its interruptions
    failures, wall = (len(run.failures), run.wall_s) if run is not None else (0, None)
    if mtbf_hours:
        mtbf, source = mtbf_hours * 3600, "spec"
    elif failures and wall:
        mtbf, source = wall / failures, "observed"
    else:
        mtbf, source = None, "unknown"
    per_chunk = chunk_steps // save_freq if save_freq and save_freq < chunk_steps else 1
    return SaveInterval(
        step_s=statistics.median(float(r["seconds"]) for r in rows),
        save_s=statistics.median(saves),
        validation_s=statistics.median(checks) if checks else 0.0,
        restart_s=restart_seconds(events, rows),
        mtbf_s=mtbf,
        failures=failures if source == "observed" else 0,
        mtbf_source=source,
        saves_per_chunk=max(1, per_chunk),
        chunk_steps=chunk_steps,
        total_steps=total_steps,
    )


def interruptions(events: list[dict]) -> int:
    """Attempts that ended before their chunk's end: failed, stopped early, or killed (the goodput ledger's)."""
    return sum(1 for a in goodput.attempts_of(events) if a.outcome in goodput.INTERRUPTED)


def restart_seconds(events: list[dict], rows: list[dict]) -> float | None:
    """Median of each attempt's start-up: its process's start to the start of its first step."""
    spans = []
    for e in events:
        if e.get("event") != "chunk_start" or not _num(e.get("process_started")):
            continue
        first = next((r for r in rows if r.get("attempt") == e.get("attempt")), None)
        if first is not None and _num(first.get("time")):
            spans.append(float(first["time"]) - float(first["seconds"]) - float(e["process_started"]))
    return statistics.median(spans) if spans else None


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _s(seconds: float | None) -> str:
    if seconds is None:
        return "not measured"
    return f"{seconds / 3600:.1f}h" if seconds >= 3600 else f"{seconds:.1f}s"
