"""The run's ETA against alerts.deadline (relay.insights.eta): from its median step time and the time its chunks
spend outside their steps, checked against a hand computation; a bad deadline is refused with its key."""

from __future__ import annotations

import json

import pytest

from relay.common.errors import SpecError
from relay.common.timestamps import event_time
from relay.insights.eta import eta
from relay.runs import layout
from relay.spec.run_spec import load_spec
from support.helpers import write_spec

T0 = 1_800_000_000.0


def test_the_eta_is_the_steps_left_at_the_median_pace_plus_the_chunk_boundaries_left(tmp_path):
    """Two chunks of 10 steps of 2 s each, each chunk 40 s of wall time in all: 20 s of steps, so 20 s outside them
    (start-up, save, exit). 100 steps in chunks of 10, 20 done: 80 steps × 2 s + 8 boundaries × 20 s."""
    rows, events = [], []
    for c, start in ((1, 0.0), (2, 40.0)):
        attempt = f"a{c}"
        events.append(
            {
                "event": "chunk_start",
                "attempt": attempt,
                "chunk": c,
                "time": event_time(T0 + start),
                "resumed_from": (c - 1) * 10,
                "to_step": c * 10,
            }
        )
        for k in range(10):
            rows.append(
                {"step": (c - 1) * 10 + k + 1, "attempt": attempt, "seconds": 2.0, "time": T0 + start + 10 + 2.0 * (k + 1)}
            )
        events.append(
            {"event": "chunk_end", "attempt": attempt, "chunk": c, "end_step": c * 10, "time": event_time(T0 + start + 40)}
        )
    (tmp_path / layout.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / layout.EVENTS).write_text("".join(json.dumps(e) + "\n" for e in events))

    now = T0 + 100
    e = eta(tmp_path, total_steps=100, chunk_steps=10, latest_step=20, deadline=T0 + 500, now=now)
    assert (e.steps_left, e.step_s, e.chunks_left, e.boundary_s) == (80, 2.0, 8, 20.0)
    assert e.at == now + 80 * 2.0 + 8 * 20.0 and e.late_s == pytest.approx(e.at - (T0 + 500))
    assert e.late_s < 0 and "before the deadline" in e.describe()
    late = eta(tmp_path, total_steps=100, chunk_steps=10, latest_step=20, deadline=T0 + 200, now=now)
    assert late.late_s == pytest.approx(220) and "3m40s past the deadline" in late.describe()
    assert eta(tmp_path / "none", total_steps=100, chunk_steps=10, latest_step=0) is None, "no step, no ETA"


def test_a_deadline_must_be_one_instant(tmp_path):
    assert load_spec(
        write_spec(tmp_path / "ok", **{"alerts.deadline": "2026-12-24T18:00:00+01:00"}), check_environment=False
    ).alerts.deadline
    for bad in ("next friday", "2026-12-24T18:00:00"):
        with pytest.raises(SpecError, match=r"alerts\.deadline"):
            load_spec(write_spec(tmp_path / "bad", **{"alerts.deadline": bad}), check_environment=False)
