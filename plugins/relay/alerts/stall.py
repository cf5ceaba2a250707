"""Stalls: a chunk whose job is alive but makes no new step (a rollout hang, a deadlocked collective).

The limit is the spec's alerts.stall_minutes, or else stall_factor x the run's median step time
(from metrics.jsonl), at least stall_floor_minutes. A job gets startup_minutes more before its first
step (imports, model build and resume come before it) and after its chunk's last step (the save, its
fsync and the job's exit come after it): neither is a step-less stretch of training.
"""

from __future__ import annotations

import statistics

from relay.common.progress import STEP_LINE
from relay.runs.metrics import MetricsLog
from relay.runs.run import Run


def stall_limit_s(run: Run) -> float:
    """Seconds without a new step after which a chunk of the run is stalled."""
    a = run.spec.alerts
    if a.stall_minutes:
        return a.stall_minutes * 60
    seconds = [r["seconds"] for r in MetricsLog(run.dir).rows() if isinstance(r.get("seconds"), (int, float))]
    floor = a.stall_floor_minutes * 60
    return max(floor, a.stall_factor * statistics.median(seconds)) if seconds else floor


class StallWatch:
    """Follows a job's steps (its heartbeat, relay.runs.heartbeat, and its log's step lines) and says when it
    has gone `limit_s` without a new one."""

    def __init__(self, limit_s: float, startup_s: float, started_at: float, end_step: int | None = None):
        self.limit_s = limit_s
        self.startup_s = startup_s
        self.end_step = end_step  # the chunk's last step: after it the job saves and exits
        self.last_step: int | None = None
        self.since = started_at  # when the last step was seen, or the watch started

    def saw(self, new_log_text: str, now: float) -> None:
        steps = STEP_LINE.findall(new_log_text)
        if steps:
            self.saw_step(int(steps[-1]), now)

    def saw_step(self, step: int | None, now: float) -> None:
        """The job's newest step now (None: not known)."""
        if step is not None and step != self.last_step and (self.last_step is None or step > self.last_step):
            self.last_step = step
            self.since = now

    def paused(self, now: float) -> None:
        """A wait that is not a stall (a warm chunk's job waiting for its admission, which its own limit bounds):
        the step-less stretch starts again from now."""
        self.since = now

    def stalled(self, now: float) -> str | None:
        """None while the job makes progress; else why it is stalled, in words."""
        saving = self.last_step is not None and self.end_step is not None and self.last_step >= self.end_step
        allowed = self.limit_s + (self.startup_s if self.last_step is None or saving else 0)
        idle = now - self.since
        if idle <= allowed:
            return None
        if self.last_step is None:
            after = "since the job started"
        else:
            after = f"after step {self.last_step}" + (", the chunk's last (saving)" if saving else "")
        return f"no new step for {idle:.0f}s {after} (limit {allowed:.0f}s)"
