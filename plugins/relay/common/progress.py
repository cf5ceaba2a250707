"""The progress line every trainer prints once per step, and its reader (the stall watch, the trigger).

    [relay] step 21/60 chunk 2 eta 15s (run eta 31s) 0.786 s/step reward_mean=0.276 loss=0.0141 kl=1.25 lr=0.003

The ETA comes first and only a few values follow (every value is in metrics.jsonl), so the line
reads whole in Airflow's log view.
"""

from __future__ import annotations

import re
from typing import Any

PREFIX = "[relay] "
STEP_LINE = re.compile(r"^\[relay\] step (\d+)/\d+", re.MULTILINE)
SHOWN = ("reward_mean", "loss", "kl", "lr")  # the rest stays in metrics.jsonl


def step_line(
    step: int, total: int, chunk: int | None, chunk_end: int, recent_seconds: list[float], values: dict[str, Any]
) -> str:
    """The line for `step` (without the "[relay] " prefix): the time left in the chunk (eta) and in the whole run
    (run eta) first, from the mean of the recent steps' seconds."""
    per = sum(recent_seconds) / len(recent_seconds) if recent_seconds else 0.0
    shown = " ".join(f"{k}={values[k]:.3g}" for k in SHOWN if isinstance(values.get(k), (int, float)))
    return (
        f"step {step}/{total} chunk {chunk or '-'} eta {duration(per * (chunk_end - step))} "
        f"(run eta {duration(per * (total - step))}) {per:.3g} s/step {shown}"
    ).rstrip()


def duration(seconds: float) -> str:
    """12s, 4m05s, 2h03m: short enough for a progress line."""
    s = int(round(max(seconds, 0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
