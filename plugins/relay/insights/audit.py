"""The replay audit: proof that a resume changed nothing.

The steps between a resume point and the failure before it are trained twice. The first try's rows are kept
in metrics.superseded.jsonl (relay.runs.metrics), the second's are the run's own rows in metrics.jsonl. A
resume that restored everything (weights, optimizer, LR schedule, dataloader position, every RNG) trains each
of those steps again to the same values; a resume that lost some state does not, and this says at which
step and in which metric.

Every logged value is compared except bookkeeping (when and by whom a step was trained: BOOKKEEPING). The
comparison is exact unless the spec's `audit.tolerance` allows an absolute difference for a metric (verl on
GPUs: its generation need not repeat bit for bit); `"*"` there applies to every metric it does not name.
Relay's CPU trainer and verl's CPU path are exact. `relay audit RUN_DIR` runs it at any time.

For verl's asynchronous trainers it also runs the prompt audit (relay.insights.prompts): every prompt handed out
trained exactly once (or evicted with a recorded reason), with the staleness of a run never stopped (bitwise) or
within its bound (lossless). A lossless resume does not promise that a step trained again trains the same prompts
or the same values (verl's loop picks what finished first): its steps trained twice compare what it does promise,
the step and its LR (LOSSLESS_REPLAY), and the prompt audit proves the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relay.insights.prompts import PromptAudit, audit_prompts
from relay.runs import layout
from relay.runs.metrics import SUPERSEDED, read_jsonl

# When, where and by whom a step was trained: never the same in two tries, and not what the step computed.
BOOKKEEPING = frozenset({"seconds", "time", "attempt", "chunk", "superseded_by"})
ANY = "*"  # audit.tolerance's key for the metrics it does not name
# What a step trained again at another world size (an elastic run) must keep: its data, its LR, its global batch
ACROSS_WORLD_SIZES = frozenset({"step", "lr", "sample_indices", "prompt_ids", "train_batch_size", "rollouts"})
LOSSLESS_REPLAY = frozenset({"step", "lr"})  # what a lossless async resume repeats of a step trained twice


@dataclass
class Divergence:
    step: int
    metric: str
    first: Any  # the first try's value (metrics.superseded.jsonl)
    again: Any  # the kept row's (metrics.jsonl)
    tolerance: float
    first_attempt: str = ""
    again_attempt: str = ""

    def describe(self) -> str:
        allowed = f" (tolerance {self.tolerance:g})" if self.tolerance else " (exact)"
        return f"step {self.step}: {self.metric} {_show(self.first)} on its first try, {_show(self.again)} again{allowed}"


@dataclass
class AuditReport:
    run_dir: str
    compared: int = 0  # superseded rows compared with the step's kept row
    steps: list[int] = field(default_factory=list)  # the steps trained twice that were compared
    divergences: list[Divergence] = field(default_factory=list)
    not_retrained: list[int] = field(default_factory=list)  # superseded steps the run has not trained again yet
    across_world_sizes: list[int] = field(default_factory=list)  # steps trained again at another world size
    lossless: bool = False  # a lossless async run: steps trained twice compare LOSSLESS_REPLAY only
    prompts: PromptAudit | None = None  # verl's async trainers: each prompt handed out trained once

    @property
    def consistent(self) -> bool:
        return not self.divergences and (self.prompts is None or self.prompts.consistent)

    def summary(self) -> str:
        if not self.compared:
            head = "replay audit: no step was trained twice (nothing to compare)"
        elif self.consistent:
            same = (
                "its LR as on the first try (lossless: the prompts by the prompt audit)"
                if self.lossless
                else ("every metric as on the first try")
            )
            head = f"replay audit: consistent: {len(self.steps)} step(s) trained twice ({_ranges(self.steps)}), {same}"
        else:
            bad = sorted({d.step for d in self.divergences})
            head = (
                f"replay audit: DIVERGED at step(s) {_ranges(bad)} of the {len(self.steps)} trained twice: the run "
                "after a resume is not the run it would have been"
            )
        lines = [head] + [f"  {d.describe()}" for d in self.divergences[:20]]
        if len(self.divergences) > 20:
            lines.append(f"  ... and {len(self.divergences) - 20} more")
        if self.not_retrained:
            lines.append(f"  not trained again yet: step(s) {_ranges(self.not_retrained)}")
        if self.prompts is not None:
            lines.append(self.prompts.summary())
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**asdict(self), "consistent": self.consistent}


def audit(run_dir: Path | str, tolerance: Mapping[str, float] | None = None) -> AuditReport:
    """Compare every superseded row of a run with the row its step has now."""
    run_dir = Path(run_dir)
    report = AuditReport(str(run_dir))
    rows = read_jsonl(run_dir / layout.METRICS)
    kept = {r["step"]: r for r in rows if isinstance(r.get("step"), int)}
    sizes = {  # an elastic run's attempts' world sizes: a step trained again at another compares what it keeps
        e.get("attempt"): e.get("world_size") for e in read_jsonl(run_dir / layout.EVENTS) if e.get("event") == "chunk_start"
    }
    steps = set()
    report.prompts = audit_prompts(run_dir, rows)
    report.lossless = report.prompts is not None and report.prompts.exactness == "lossless"
    for first in read_jsonl(run_dir / SUPERSEDED):
        step = first.get("step")
        if not isinstance(step, int):
            continue
        again = kept.get(step)
        if again is None:
            report.not_retrained.append(step)
            continue
        report.compared += 1
        steps.add(step)
        metrics = (set(first) | set(again)) - BOOKKEEPING
        if sizes.get(first.get("attempt")) != sizes.get(again.get("attempt")):
            # The reduction order changed with the world size: losses and samples differ in their last bits. The
            # data order, the LR and the batch do not.
            metrics &= ACROSS_WORLD_SIZES
            report.across_world_sizes.append(step)
        if report.lossless:
            metrics &= LOSSLESS_REPLAY
        for metric in sorted(metrics):
            tol = float((tolerance or {}).get(metric, (tolerance or {}).get(ANY, 0.0)))
            a, b = first.get(metric), again.get(metric)
            if not _same(a, b, tol):
                report.divergences.append(
                    Divergence(step, metric, a, b, tol, str(first.get("attempt", "")), str(again.get("attempt", "")))
                )
    report.steps = sorted(steps)
    report.not_retrained = sorted(set(report.not_retrained))
    return report


def _same(a: Any, b: Any, tol: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not (_number(a) and _number(b)):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b if tol == 0 else abs(a - b) <= tol


def _number(v: Any) -> bool:
    return isinstance(v, (int, float))


def _show(v: Any) -> str:
    if v is None:
        return "(absent)"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _ranges(steps: list[int]) -> str:
    """3, 5-9, 12: a list of steps in few characters."""
    groups: list[list[int]] = []
    for s in sorted(set(steps)):
        if groups and s == groups[-1][1] + 1:
            groups[-1][1] = s
        else:
            groups.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in groups)
