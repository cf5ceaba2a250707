"""The goodput ledger: where a run's wall time went, and what its failures cost.

Built from what the run's folder records, nothing else: the phase events and the timed events in events.jsonl
(relay.runs.phases names them all), the step rows in metrics.jsonl, and the rows of steps trained again in
metrics.superseded.jsonl. So `relay report`, the run report, the finish task and the overhead benchmark read
the same figures, from the folder or from its copy in S3, with or without Airflow.

The wall time runs from the first chunk attempt's start (its train task, or `relay train`'s process) to the
last thing the run recorded. Every instant of it is given to exactly one part (PARTS), so the parts add up to
the wall time: where several timed things ran at once, the one earlier in PRIORITY takes the instant; an
instant where none of them ran goes to a step, teardown, retry_wait, scheduling, publication (a publish the
run waited on, not one beside the next chunk's training) or idle, by where it lies (`_gap`).

Effective training time = the time of the steps kept ÷ the wall time (Meta reported >90% for Llama 3's
pre-training over 419 interruptions). Per failure (an attempt that failed, was killed or stopped early): its
cause where one was classified (relay.runs.failure_cause), the steps it lost (its rows that a resume
superseded) and their time, and the time to recover: from its end to the moment a later attempt begins the
first step it had not trained.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay.common.timestamps import epoch, event_time
from relay.runs import layout
from relay.runs.metrics import SUPERSEDED, read_events, read_jsonl
from relay.runs.phases import EVENT as PHASE

VERSION = 1
# The parts of a run's wall time (the keys of `relay report --json`'s goodput.parts), each in one line.
PARTS = {
    "scheduling": "Airflow between Relay's tasks: a task waiting for its upstream and a worker, a deferred task resumed",
    "submission": "the train task running -> its Ray job running: Relay's checks before a chunk, the submission, "
    "Ray's runtime env",
    "capacity_wait": "an elastic chunk waiting for the cluster's nodes: below its minimum world size, or for a lost "
    "node's return (elastic.wait_for_nodes_minutes)",
    "startup": "the job (or `relay train`'s process) running -> its first step: imports, model build, resume load",
    "handoff": "a warm chunk's start in the job that ended the chunk before (its end's commit -> its first step), "
    "and its wait for the chunk's admission before its first commit",
    "training": "steps whose results the run kept",
    "trained_twice": "steps trained again after a resume: their first try (rows in metrics.superseded.jsonl)",
    "save": "checkpoint saves and their commits",
    "validation": "the gate's checks of a checkpoint",
    "publication": "uploads to S3 while nothing else ran (the run waited on them)",
    "teardown": "a trainer's end after its last step or save: its exit, Ray's job end, Airflow noticing it",
    "retry_wait": "a failed attempt's end -> its retry starting (Airflow's retry delay, a backoff, a person)",
    "idle": "nothing of the run ran: between DAG runs, or between `relay train` commands",
}
# Which part takes an instant where several ran. Publication is not among them: chunk k publishes while chunk
# k+1 trains, so it counts only where the run waited on it (`_gap`); the other parts are gaps.
PRIORITY = ("save", "validation", "trained_twice", "training", "handoff", "startup", "capacity_wait", "submission")
INTERRUPTED = ("failed", "killed", "stopped")
OPENING = ("task_started", "job_submitted", "job_started")  # the marks that may open an attempt


@dataclass
class Attempt:
    """One chunk attempt: a Ray job (its submission id) or one `relay train` process."""

    attempt: str
    chunk: int | None = None
    dag_run: str | None = None
    try_number: int | None = None
    resumed_from: int = 0
    to_step: int = 0
    start: float = 0.0
    end: float = 0.0
    outcome: str = "running"  # finished | failed | killed | stopped | running
    warm: bool = False  # started warm, in the job that trained the chunk before (chunks.handoff: warm)
    cause: str | None = None  # where classified (chunk_failed), or the reason a stopped attempt gave
    last_step: int | None = None  # the last step it trained
    steps_kept: int = 0
    steps_lost: int = 0
    parts: dict[str, float] = field(default_factory=dict)
    # what the ledger reads, not reported
    _marks: dict[str, float] = field(default_factory=dict, repr=False)
    _events: list[dict] = field(default_factory=list, repr=False)
    _rows: list[tuple[float, float, dict, bool]] = field(default_factory=list, repr=False)  # begin, end, row, kept

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        return {
            **out,
            "start": event_time(self.start),
            "end": event_time(self.end),
            "seconds": round(self.seconds, 3),
            "parts": _rounded(self.parts),
        }


@dataclass
class Failure:
    attempt: str
    chunk: int | None
    cause: str  # a cause of relay.runs.failure_cause, "stopped: <reason>", or "unknown"
    outcome: str  # failed | killed | stopped
    step: int | None  # the last step it trained
    steps_lost: int
    lost_s: float  # the lost steps' time
    failed_at: float
    recovered_at: float | None  # a later attempt begins the first step this one had not trained
    time_to_recover_s: float | None

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "failed_at": event_time(self.failed_at),
            "lost_s": round(self.lost_s, 3),
            "recovered_at": event_time(self.recovered_at) if self.recovered_at is not None else None,
            "time_to_recover_s": None if self.time_to_recover_s is None else round(self.time_to_recover_s, 3),
        }


@dataclass
class Ledger:
    start: float
    end: float
    parts: dict[str, float]
    steps_kept: int
    steps_lost: int  # rows superseded by resumes: steps trained and thrown away
    attempts: list[Attempt]
    failures: list[Failure]
    # An elastic run's world size over time (start, end, size) from its chunk starts, and its largest allowed
    world_sizes: list[tuple[float, float, int]] = field(default_factory=list)
    largest_world_size: int | None = None

    @property
    def below_largest_s(self) -> float:
        """Seconds the run trained below its largest world size (an elastic run on a smaller cluster)."""
        top = self.largest_world_size
        return sum(end - start for start, end, size in self.world_sizes if top is not None and size < top)

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def effective_training(self) -> float:
        """The time of the steps kept ÷ the wall time."""
        return self.parts["training"] / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def mtbf_s(self) -> float | None:
        """Mean time between failures observed: the wall time over the interruptions (None without one)."""
        return self.wall_s / len(self.failures) if self.failures else None

    def chunks(self) -> list[dict]:
        """Per chunk: its attempts and its parts (idle is the run's alone: no attempt owns it)."""
        out: dict[tuple, dict] = {}
        for a in self.attempts:  # an attempt with no chunk index (a step outside the plan): by its end step
            key = (0, a.chunk) if a.chunk is not None else (1, a.to_step)
            c = out.setdefault(
                key, {"chunk": a.chunk, "to_step": a.to_step, "attempts": 0, "parts": dict.fromkeys(PARTS, 0.0)}
            )
            c["attempts"] += 1
            for k, v in a.parts.items():
                c["parts"][k] += v
        for c in out.values():
            c["seconds"] = round(sum(c["parts"].values()), 3)
            c["parts"] = _rounded(c["parts"])
        return [out[k] for k in sorted(out)]

    def summary(self) -> str:
        """One line for a log or an alert."""
        if self.wall_s <= 0:
            return "goodput: no wall time recorded yet"
        top = sorted(((v, k) for k, v in self.parts.items() if v > 0 and k != "training"), reverse=True)[:4]
        line = (
            f"goodput {self.effective_training:.1%}: the steps kept took {_clock(self.parts['training'])} of "
            f"{_clock(self.wall_s)} wall time; " + ", ".join(f"{k} {v / self.wall_s:.1%}" for v, k in top)
        )
        if self.below_largest_s > 0:
            line += f"; below its largest world size ({self.largest_world_size}) for {_clock(self.below_largest_s)}"
        if not self.failures:
            return line + "; no failure"
        recovered = [f.time_to_recover_s for f in self.failures if f.time_to_recover_s is not None]
        return (
            line + f"; {len(self.failures)} failure(s): {self.steps_lost} step(s) lost "
            f"({self.parts['trained_twice']:.1f}s trained twice)"
            + (f", recovered in {_clock(max(recovered))} at most" if recovered else "")
            + f"; MTBF {_clock(self.mtbf_s or 0)} observed"
        )

    def describe(self) -> str:
        """The summary, every part's time and share, and one line per failure: the finish task's log and alert."""
        lines = [self.summary(), "where the wall time went:"]
        lines += [f"  {k:<14} {v:>10.1f}s {v / self.wall_s if self.wall_s else 0:>7.1%}" for k, v in self.parts.items()]
        for f in self.failures:
            recovered = "not yet" if f.time_to_recover_s is None else f"in {f.time_to_recover_s:.1f}s"
            lines.append(
                f"failure: chunk {f.chunk if f.chunk is not None else '-'} attempt {f.attempt} {f.outcome} "
                f"after step {f.step if f.step is not None else '-'} ({f.cause}): {f.steps_lost} step(s) lost "
                f"({f.lost_s:.1f}s), recovered {recovered}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """`relay report --json`'s `goodput`: stable keys, documented in docs/guides/report.md."""
        return {
            "version": VERSION,
            "start": event_time(self.start),
            "end": event_time(self.end),
            "wall_s": round(self.wall_s, 3),
            "parts": _rounded(self.parts),
            "effective_training": round(self.effective_training, 4),
            "steps_kept": self.steps_kept,
            "steps_lost": int(self.steps_lost),
            "trained_twice_s": round(self.parts["trained_twice"], 3),
            "failures_n": len(self.failures),
            "mtbf_s": None if self.mtbf_s is None else round(self.mtbf_s, 3),
            "failures": [f.to_dict() for f in self.failures],
            "chunks": self.chunks(),
            "attempts": [a.to_dict() for a in self.attempts],
            "world_size": {
                "largest": self.largest_world_size,
                "below_largest_s": round(self.below_largest_s, 3),
                "spans": [{"start": event_time(s), "end": event_time(e), "world_size": w} for s, e, w in self.world_sizes],
            },
        }


# ---------------------------------------------------------------------------------------- building
def ledger(run_dir: Path | str) -> Ledger | None:
    """The run's ledger; None before any chunk attempt started."""
    run_dir = Path(run_dir)
    return build(read_events(run_dir), read_jsonl(run_dir / layout.METRICS), read_jsonl(run_dir / SUPERSEDED))


def build(events: list[dict], kept: list[dict], superseded: list[dict]) -> Ledger | None:
    attempts = attempts_of(events, kept, superseded)
    if not attempts:
        return None
    spans = _spans(attempts, events)
    start = min(a.start for a in attempts)
    end = max([a.end for a in attempts] + [s[1] for s in spans])
    parts = dict.fromkeys(PARTS, 0.0)
    # A sweep over the spans' ends: between two of them the same spans run, and the first part of PRIORITY
    # among them takes the time (or, with none, the gap's part).
    changes: dict[float, list[tuple[int, int]]] = {}
    for i, (lo, hi, _, _) in enumerate(spans):
        lo, hi = min(max(lo, start), end), min(max(hi, start), end)
        if hi > lo:
            changes.setdefault(lo, []).append((1, i))
            changes.setdefault(hi, []).append((-1, i))
    for a in attempts:
        changes.setdefault(a.start, [])
        changes.setdefault(a.end, [])
    changes.setdefault(start, [])
    changes.setdefault(end, [])
    active: dict[str, dict[int, None]] = {part: {} for part in (*PRIORITY, "publication")}  # ordered sets
    by_start = sorted(attempts, key=lambda a: a.start)
    starts = [a.start for a in by_start]
    points = sorted(changes)
    for p, q in itertools.pairwise(points):
        for sign, i in changes[p]:
            if sign > 0:
                active[spans[i][2]][i] = None
            else:
                active[spans[i][2]].pop(i, None)
        top = next((part for part in PRIORITY if active[part]), None)
        if top is not None:
            part, owner = top, spans[next(reversed(active[top]))][3]
        else:
            publisher = spans[next(reversed(active["publication"]))][3] if active["publication"] else None
            part, owner = _gap((p + q) / 2, by_start, starts, bool(active["publication"]), publisher)
        parts[part] += q - p
        if owner is not None:
            owner.parts[part] = owner.parts.get(part, 0.0) + q - p
    failures = _failures(attempts)
    sizes = world_sizes(events, end)
    chosen = [int(e["largest"]) for e in events if e.get("event") == "world_size" and e.get("largest")]
    return Ledger(
        start,
        end,
        parts,
        steps_kept=len(kept),
        steps_lost=len(superseded),
        attempts=attempts,
        failures=failures,
        world_sizes=sizes,
        largest_world_size=max(chosen + [w for *_, w in sizes], default=None),
    )


def world_sizes(events: list[dict], end: float) -> list[tuple[float, float, int]]:
    """The run's world size over time: from each chunk start (a warm one too) that says its size to the next one,
    the last to `end`; empty when no chunk start says it."""
    starts = [
        (t, int(e["world_size"]))
        for e in events
        if e.get("event") == "chunk_start" and e.get("world_size") and (t := epoch(e.get("time"))) is not None
    ]
    ends = [t for t, _ in starts[1:]] + [max(end, starts[-1][0])] if starts else []
    return [(t, stop, w) for (t, w), stop in zip(starts, ends, strict=True)]


def attempts_of(events: list[dict], kept: Sequence[dict] = (), superseded: Sequence[dict] = ()) -> list[Attempt]:
    """The run's chunk attempts, in order, with their outcome. One attempt per Ray job and chunk (a train task's
    later try that adopted the job joins it; a job that went on warm into the next chunk begins another there) and
    one per `relay train` process (all of them named "local": a new chunk_start begins a new one)."""
    timed = sorted(
        ((t, i, e) for i, e in enumerate(events) if (t := epoch(e.get("time"))) is not None), key=lambda x: (x[0], x[1])
    )
    out: list[Attempt] = []

    def latest(attempt, chunk=None) -> Attempt | None:
        """Events come in time order: the newest attempt of that name (and chunk, where both have one) is theirs."""
        return next((a for a in reversed(out) if a.attempt == attempt and (chunk is None or a.chunk in (None, chunk))), None)

    for t, _, e in timed:
        kind, attempt = e.get("event"), e.get("attempt")
        if attempt is None:
            continue
        attempt = str(attempt)
        if kind == PHASE and e.get("phase") in OPENING:  # recorded before the trainer's chunk_start (Ray's time)
            a = latest(attempt, e.get("chunk"))
            if a is None:
                out.append(a := Attempt(attempt, chunk=e.get("chunk"), start=t))
            if e.get("phase") == "task_started":
                a.dag_run, a.try_number = e.get("dag_run") or a.dag_run, e.get("try_number") or a.try_number
            a._marks.setdefault(e["phase"], t)  # a later try that adopts the job keeps the first try's start
            continue
        if kind == "chunk_start":
            a = latest(attempt, e.get("chunk"))
            if a is None or "chunk_start" in a._marks:  # relay train's processes are all "local"
                out.append(a := Attempt(attempt, start=t))
            a._marks["chunk_start"] = t
            a.warm = bool(e.get("warm"))
            a.chunk = e.get("chunk") if e.get("chunk") is not None else a.chunk
            a.resumed_from, a.to_step = int(e.get("resumed_from") or 0), int(e.get("to_step") or 0)
            if (p := epoch(e.get("process_started"))) is not None and abs(p - t) < 86400:
                a._marks["process_started"] = p
            continue
        a = latest(attempt, e.get("chunk"))
        if a is None:
            continue
        if kind == PHASE:
            a._marks[str(e.get("phase"))] = t
        a._events.append({**e, "_t": t})
    for rows, is_kept in ((kept, True), (superseded, False)):
        for r in rows:
            t, s = _float(r.get("time")), _float(r.get("seconds"))
            if t is None or s is None or r.get("attempt") is None:
                continue
            # A row is written after its attempt's chunk_start: the newest attempt of its name that had begun.
            same = [a for a in out if a.attempt == str(r["attempt"])]
            a = next((a for a in reversed(same) if a._marks.get("chunk_start", a.start) <= t), same[0] if same else None)
            if a is not None:
                a._rows.append((t - s, t, r, is_kept))
    for i, a in enumerate(out):
        _close(a, later=out[i + 1 :])
    return out


def _close(a: Attempt, later: list[Attempt]) -> None:
    """The attempt's start, end, outcome, cause and steps, from what was attributed to it."""
    a._rows.sort(key=lambda x: x[0])
    m = a._marks
    a.start = min(t for k, t in m.items() if k in (*OPENING, "process_started", "chunk_start"))
    ends = [t for k, t in m.items()] + [e["_t"] for e in a._events] + [r[1] for r in a._rows]
    a.end = max([*ends, a.start])
    steps = [int(r[2]["step"]) for r in a._rows if isinstance(r[2].get("step"), int)]
    a.last_step = max(steps) if steps else None
    a.steps_kept = sum(1 for r in a._rows if r[3])
    a.steps_lost = sum(1 for r in a._rows if not r[3])
    kinds = {e.get("event"): e for e in a._events}  # the last of each kind
    if "chunk_failed" in kinds:
        a.outcome, a.cause = "failed", kinds["chunk_failed"].get("cause") or "unknown"
        if "chunk_stopped" in kinds:
            a.outcome = "stopped"
    elif "chunk_stopped" in kinds:
        a.outcome, a.cause = "stopped", f"stopped: {kinds['chunk_stopped'].get('reason') or 'asked to'}"
    elif "chunk_end" in kinds:
        done = kinds["chunk_end"].get("end_step")
        a.outcome = "finished" if not isinstance(done, int) or done >= a.to_step else "failed"
    elif later or "job_ended" in m or "task_done" in m:
        a.outcome = "killed"


def _spans(attempts: list[Attempt], events: list[dict]) -> list[tuple[float, float, str, Attempt | None]]:
    """(start, end, part, attempt) of everything timed."""
    spans: list[tuple[float, float, str, Attempt | None]] = []
    committed: dict[int, Attempt] = {}
    for a in attempts:
        m = a._marks
        trainer = next((m[k] for k in ("job_started", "process_started", "chunk_start") if k in m), a.start)
        if "task_started" in m and trainer > m["task_started"]:
            spans.append((m["task_started"], trainer, "submission", a))
        first = a._rows[0][0] if a._rows else None
        spans.append(
            (trainer, first if first is not None else max(trainer, _trainer_end(a)), "handoff" if a.warm else "startup", a)
        )
        previous_end = None
        for begin, end, _, is_kept in a._rows:
            # The time between two steps (the next batch drawn, the row written) goes to the next step.
            if previous_end is not None and previous_end < begin:
                begin = previous_end
            spans.append((begin, end, "training" if is_kept else "trained_twice", a))
            previous_end = end
        for e in a._events:
            if e.get("event") == "handoff_wait" and _num(e.get("seconds")):
                spans.append((e["_t"] - float(e["seconds"]), e["_t"], "handoff", a))
            if e.get("event") == "checkpoint" and _num(e.get("seconds")):
                # A save off the critical path: only its copy, which training waited for, ending at blocking_until.
                until = float(e["blocking_until"]) if _num(e.get("blocking_until")) else e["_t"]
                spans.append((until - float(e["seconds"]), until, "save", a))
                if isinstance(e.get("step"), int):
                    committed[e["step"]] = a
    for e in events:
        t = epoch(e.get("time"))
        if e.get("event") == "world_size" and t is not None and _num(e.get("waited_s")):
            spans.append((t - float(e["waited_s"]), t, "capacity_wait", None))
        part = {"validation": "validation", "publish": "publication"}.get(str(e.get("event")))
        if part and t is not None and _num(e.get("seconds")):
            spans.append((t - float(e["seconds"]), t, part, committed.get(e.get("step"))))  # type: ignore[arg-type]
    return [s for s in spans if s[1] > s[0]]


def _trainer_end(a: Attempt) -> float:
    """The last thing the attempt's trainer did (its events), before Ray and Airflow noticed its end."""
    own = [e["_t"] for e in a._events if e.get("event") in ("chunk_end", "chunk_stopped", "checkpoint")]
    return max(own) if own else a._marks.get("job_ended", a.end)


def _gap(
    at: float, by_start: list[Attempt], starts: list[float], publishing: bool, publisher: Attempt | None
) -> tuple[str, Attempt | None]:
    """The part and owner of an instant where nothing but perhaps a publication ran (`publisher`: the attempt
    that saved what is being published). Inside an attempt: its steps' or its teardown. Between two: the
    wait for a retry after a failure, or Airflow between the tasks of one DAG run; else a publication, if one
    ran (the run waited on it), or Airflow after the last attempt; else idle."""
    inside = [a for a in by_start if a.start <= at < a.end]
    if inside:
        a = inside[-1]
        k = bisect.bisect_left([r[0] for r in a._rows], at)
        if k < len(a._rows):  # before one of its steps (and after its start-up)
            return ("training" if a._rows[k][3] else "trained_twice"), a
        return "teardown", a
    i = bisect.bisect_right(starts, at)
    nxt = by_start[i] if i < len(by_start) else None
    prev = max((a for a in by_start[:i] if a.end <= at), key=lambda a: a.end, default=None)
    if prev is not None and prev.outcome in INTERRUPTED and nxt is not None:
        return "retry_wait", nxt
    if prev is not None and prev.dag_run is not None and nxt is not None and nxt.dag_run == prev.dag_run:
        return "scheduling", nxt  # within one DAG run: Airflow between its tasks
    if publishing:
        return "publication", publisher or prev
    if prev is not None and prev.dag_run is not None and nxt is None:
        return "scheduling", prev  # the DAG run's last tasks (validate, publish, finish)
    return "idle", None


def _failures(attempts: list[Attempt]) -> list[Failure]:
    out = []
    for i, a in enumerate(attempts):
        if a.outcome not in INTERRUPTED:
            continue
        lost = [r for r in a._rows if not r[3]]
        trained = a.last_step if a.last_step is not None else a.resumed_from
        recovered = None
        for b in attempts[i + 1 :]:
            new = next((r for r in b._rows if r[2].get("step") == trained + 1), None)
            again = next((r for r in b._rows if r[2].get("step") == trained), None)
            if new is not None or (again is not None and b.outcome == "finished" and b.to_step == trained):
                recovered = new[0] if new is not None else again[1]  # type: ignore[index]
                break
        out.append(
            Failure(
                a.attempt,
                a.chunk,
                a.cause or "unknown",
                a.outcome,
                a.last_step,
                len(lost),
                sum(r[1] - r[0] for r in lost),
                a.end,
                recovered,
                recovered - a.end if recovered is not None else None,
            )
        )
    return out


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _float(v) -> float | None:
    return float(v) if _num(v) else None


def _rounded(parts: dict[str, float]) -> dict[str, float]:
    return {k: round(parts.get(k, 0.0), 3) for k in PARTS}


def _clock(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
