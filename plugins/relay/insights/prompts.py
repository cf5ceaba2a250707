"""The prompt audit of an asynchronous verl run: every prompt handed out was trained exactly once (or evicted by verl
with its reason recorded), each within the staleness the run promises.

verl's async trainers train prompts handed out steps before (relay.runs.prompt_ledger): a kill, a
chunk boundary or a resume that loses the batch in flight skips those prompts, and one that regenerates them
trains them again or under other weights. Each kept metrics row of such a run says which prompts its step handed
out (`handed_out_seqs`, `handed_out_indices`), trained (`prompt_seqs`, `sample_indices`, `policy_versions`) and
evicted with why (`evicted_seqs`, `evicted_reasons`); the latest checkpoint lists the prompts in flight at its step.
Over the rows up to that checkpoint:

- every prompt handed out (numbered 0, 1, ... in the order the dataloader gave them) was trained once, or evicted
  once with a reason, or is in flight in the checkpoint; none trained twice, none skipped (named by dataset row);
- resume_exactness bitwise: each step trained samples generated `min(step - 1, warmup_batches)` steps before it, as
  a run that never stopped does (prompts generated under the weights they were handed out with, first in, first
  out); lossless: every trained response was generated (its oldest token) within max_staleness policy versions of
  the step that trained it.

Plain Python: run by `relay audit` with the replay audit (relay.insights.audit).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.common.errors import CheckpointError
from relay.runs import layout
from relay.runs.prompt_ledger import PromptLedger, expected_staleness
from relay.runs.record import read_record


@dataclass
class PromptAudit:
    checkpoint_step: int  # the latest checkpoint, whose prompts in flight close the account
    steps: int = 0  # rows checked (those up to the checkpoint)
    handed_out: int = 0
    trained: int = 0
    in_flight: int = 0
    skipped: list[dict] = field(default_factory=list)  # handed out, neither trained nor in flight: {seq, index}
    twice: list[dict] = field(default_factory=list)  # trained more than once: {seq, index, steps}
    staleness: dict[int, list[int]] = field(default_factory=dict)  # step -> each trained prompt's staleness
    wrong_staleness: list[dict] = field(default_factory=list)  # {step, expected, got}
    problems: list[str] = field(default_factory=list)  # what else does not add up (missing rows, records)
    exactness: str = "bitwise"  # the run's resume_exactness
    max_staleness: int | None = None  # lossless: the most policy versions a trained response spans
    evicted: list[dict] = field(default_factory=list)  # evicted by verl: {seq, index, reason, step}
    reissued: int = 0  # prompts a resume generated again (lossless)
    partial: int = 0  # trained prompts whose responses span several policy versions (partial rollouts)

    @property
    def consistent(self) -> bool:
        return not (self.skipped or self.twice or self.wrong_staleness or self.problems)

    def summary(self) -> str:
        if self.consistent:
            if self.exactness == "lossless":
                reasons = sorted({e["reason"] for e in self.evicted})
                evicted = f", {len(self.evicted)} evicted ({', '.join(reasons)})" if self.evicted else ""
                return (
                    f"prompt audit: consistent (lossless): {self.handed_out} prompt(s) handed out over {self.steps} "
                    f"step(s), {self.trained} trained once each{evicted}, {self.in_flight} in flight at step "
                    f"{self.checkpoint_step}; {self.reissued} re-issued by a resume, {self.partial} generated across "
                    f"policy versions; every response within {self.max_staleness} policy versions of its step"
                )
            return (
                f"prompt audit: consistent: {self.handed_out} prompt(s) handed out over {self.steps} step(s), "
                f"{self.trained} trained once each, {self.in_flight} in flight at step {self.checkpoint_step}; "
                "every step's staleness as in a run never stopped"
            )
        lines = [f"prompt audit: FAILED over {self.steps} step(s) up to checkpoint {self.checkpoint_step}"]
        if self.skipped:
            rows = ", ".join(str(p["index"]) for p in self.skipped[:20])
            lines.append(f"  {len(self.skipped)} prompt(s) handed out and never trained (skipped): dataset rows {rows}")
        for p in self.twice[:10]:
            lines.append(f"  prompt {p['seq']} (dataset row {p['index']}) trained more than once: steps {p['steps']}")
        for w in self.wrong_staleness[:10]:
            if self.exactness == "lossless":
                lines.append(
                    f"  step {w['step']}: trained responses generated {w['got']} steps before it, beyond "
                    f"max_staleness {self.max_staleness} policy versions"
                )
            else:
                lines.append(f"  step {w['step']}: staleness {w['got']}, a run never stopped has {w['expected']}")
        lines += [f"  {p}" for p in self.problems[:10]]
        return "\n".join(lines)


def is_async(rows: list[dict[str, Any]]) -> bool:
    return any("prompt_seqs" in r for r in rows)


def audit_prompts(run_dir: Path, rows: list[dict[str, Any]]) -> PromptAudit | None:
    """The prompt audit over a run's kept rows (None: not an async run). Without the run's checkpoints here (a report
    from S3 has its rows only), the prompts handed out after the last one trained count as in flight: first in, first
    out, the prompts trained are always the oldest."""
    if not is_async(rows):
        return None
    step = layout.read_tracker(run_dir)
    ledger: PromptLedger | None = None
    problems = []
    if step:
        try:
            ledger = PromptLedger.read(layout.step_dir(run_dir, step))
        except CheckpointError as e:
            problems.append(str(e))
    else:
        step = max(r["step"] for r in rows if isinstance(r.get("step"), int))
    warmup = ledger.warmup_batches if ledger else _warmup_of(run_dir)
    report = PromptAudit(step, problems=problems)
    report.exactness, report.max_staleness = (
        (ledger.exactness, ledger.max_staleness) if ledger else _exactness_of(run_dir, warmup)
    )
    lossless = report.exactness == "lossless"
    by_step = {r["step"]: r for r in rows if isinstance(r.get("step"), int) and r["step"] <= step}
    missing = [s for s in range(1, step + 1) if s not in by_step or "prompt_seqs" not in by_step[s]]
    if missing:
        report.problems.append(f"step(s) {missing[:10]} have no row with the prompts they trained")
    handed: dict[int, int] = {}
    trained_at: dict[int, list[int]] = defaultdict(list)
    index_of: dict[int, int] = {}
    evicted_at: dict[int, list[dict]] = defaultdict(list)
    for s in sorted(by_step):
        r = by_step[s]
        for seq, index in zip(r.get("handed_out_seqs", []), r.get("handed_out_indices", []), strict=False):
            handed[seq] = index
        for seq, index in zip(r.get("prompt_seqs", []), r.get("sample_indices", []), strict=False):
            trained_at[seq].append(s)
            index_of[seq] = index
        for seq, index, why in zip(
            r.get("evicted_seqs", []), r.get("evicted_indices", []), r.get("evicted_reasons", []), strict=False
        ):
            evicted_at[seq].append({"seq": seq, "index": index, "reason": why, "step": s})
        report.reissued += len(r.get("reissued_seqs", []))
        versions = r.get("policy_versions", [])
        report.partial += sum(1 for v in versions if isinstance(v, list) and len(set(v)) > 1)
        if lossless:  # the oldest policy a response was generated with (a partial rollout spans several)
            got: list[int | None] = [s - 1 - _oldest(v) if _oldest(v) is not None else None for v in versions]
            report.staleness[s] = [g for g in got if g is not None]
            bound = report.max_staleness
            over = sorted({g for g in report.staleness[s] if bound is not None and g > bound - 1})
            if over:
                report.wrong_staleness.append({"step": s, "expected": bound, "got": over})
            continue
        got = [s - 1 - v if isinstance(v, int) else None for v in versions]
        report.staleness[s] = [g for g in got if g is not None]
        want = expected_staleness(s, warmup) if warmup is not None else None
        if want is not None and any(g != want for g in got):
            report.wrong_staleness.append({"step": s, "expected": want, "got": sorted({str(g) for g in got})})
    if ledger is not None:
        in_flight = {p.seq: p.index for p in ledger.live.values()}
        handed_count = ledger.next_seq
    else:  # first in, first out: what was handed out after the newest prompt trained is still in flight
        newest = max(trained_at, default=-1)
        in_flight = {seq: index for seq, index in handed.items() if seq > newest}
        handed_count = max(handed, default=-1) + 1
    report.steps, report.handed_out, report.in_flight = len(by_step), len(handed), len(in_flight)
    report.trained = sum(len(v) for v in trained_at.values())
    report.evicted = [e for seq in sorted(evicted_at) for e in evicted_at[seq]]
    for seq in sorted(set(handed) | set(trained_at) | set(in_flight) | set(evicted_at)):
        steps = trained_at.get(seq, [])
        evictions = evicted_at.get(seq, [])
        ends = len(steps) + len(evictions) + (seq in in_flight)
        if ends > 1:
            settled = steps + [f"evicted at {e['step']} ({e['reason']})" for e in evictions]
            report.twice.append({"seq": seq, "index": index_of.get(seq, handed.get(seq)), "steps": settled})
        elif ends == 0:
            report.skipped.append({"seq": seq, "index": handed.get(seq)})
    never_handed = sorted(set(range(handed_count)) - set(handed))
    if never_handed:
        report.problems.append(
            f"{len(never_handed)} prompt(s) numbered below {handed_count} were never recorded as handed out "
            f"(numbers {never_handed[:10]})"
        )
    return report


def _oldest(version: Any) -> int | None:
    """The oldest policy version of a trained prompt's responses (an int, or [first, last] across a partial rollout)."""
    if isinstance(version, int):
        return version if version >= 0 else None
    if isinstance(version, list) and version and all(isinstance(v, int) for v in version):
        return min(version)
    return None


def _exactness_of(run_dir: Path, warmup: int | None) -> tuple[str, int | None]:
    """The run's resume_exactness and staleness bound from its record (a report's folder from S3 holds no
    checkpoint): the settings as verl_ppo resolves them (lossless by default on cuda, bitwise on cpu)."""
    try:
        critical = read_record(run_dir).get("resume_critical") or {}
    except Exception:  # noqa: BLE001 - no record, or an unreadable one: the bitwise check, as before
        return "bitwise", None
    exactness = critical.get("trainer.settings.resume_exactness")
    if exactness is None:
        on_gpus = critical.get("trainer.settings.device") == "cuda"
        async_mode = critical.get("trainer.settings.trainer_mode") in ("colocate_async", "separate_async")
        exactness = "lossless" if on_gpus and async_mode else "bitwise"
    bound = critical.get("trainer.settings.max_staleness")
    if not isinstance(bound, int):
        bound = warmup + 1 if isinstance(warmup, int) else None
    return str(exactness), bound


def _warmup_of(run_dir: Path) -> int | None:
    """The run's warm-up batches from its record (a report's folder from S3 holds no checkpoint)."""
    try:
        value = (read_record(run_dir).get("resume_critical") or {}).get("trainer.settings.warmup_batches")
    except Exception:  # noqa: BLE001 - no record, or an unreadable one: the staleness is then not checked
        return None
    return int(value) if isinstance(value, int) else None
