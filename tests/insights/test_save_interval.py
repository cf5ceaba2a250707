"""The save interval that fits a run (relay.insights.save_interval): Young–Daly from the run's own measured costs,
checked against a hand computation; the MTBF observed from its interruptions (flagged when fewer than 3), or
the spec's checkpoints.mtbf_hours; `relay doctor` and the run report say what to set."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from relay.insights import doctor
from relay.insights import report as run_report
from relay.insights.save_interval import interruptions, save_interval
from relay.runs import layout
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from support.helpers import write_spec

T0 = 1_800_000_000.0  # epoch seconds of the run's first attempt


def iso(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def write_run(run_dir: Path, *, killed: bool = True, failed: bool = True) -> None:
    """Steps of 0.5 s; saves of 2 s; chunk-end validations of 4 s; each attempt's first step begins 10 s after its
    process started; over 2 h, one attempt killed (no chunk_end) and one that failed (chunk_failed)."""
    run_dir.mkdir(parents=True)
    rows, events = [], []
    attempts = [("a1", 0.0, 20), ("a2", 600.0, 40), ("a3", 1200.0, 60), ("a4", 7200.0, 80)]
    for _i, (name, start, end) in enumerate(attempts):
        events.append(
            {
                "event": "chunk_start",
                "attempt": name,
                "time": iso(T0 + start),
                "resumed_from": end - 20,
                "process_started": T0 + start - 10.0,
            }
        )
        for k, step in enumerate(range(end - 19, end + 1)):
            rows.append({"step": step, "attempt": name, "seconds": 0.5, "time": T0 + start + 0.5 * (k + 1)})
        events.append({"event": "checkpoint", "step": end, "seconds": 2.0, "time": iso(T0 + start + 12)})
        events.append({"event": "validation", "step": end, "seconds": 4.0, "time": iso(T0 + start + 16)})
        if name == "a2" and failed:
            events.append({"event": "chunk_failed", "attempt": name, "cause": "exception", "time": iso(T0 + start + 17)})
        if name != "a3" or not killed:
            events.append({"event": "chunk_end", "attempt": name, "time": iso(T0 + start + 18)})
    (run_dir / layout.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / layout.EVENTS).write_text("".join(json.dumps(e) + "\n" for e in events))


def test_young_daly_matches_a_hand_computation(tmp_path):
    write_run(tmp_path / "run")
    s = save_interval(tmp_path / "run", chunk_steps=20, save_freq=10, mtbf_hours=1.0)
    assert (s.step_s, s.save_s, s.validation_s, s.restart_s) == (0.5, 2.0, 4.0, 10.0)
    assert s.saves_per_chunk == 2 and s.cost_s == 2.0 + 4.0 / 2  # the chunk's end only is validated
    assert s.young_daly_s == pytest.approx(math.sqrt(2 * 4.0 * 3600))  # 169.7 s
    assert s.young_daly_steps == pytest.approx(math.sqrt(2 * 4.0 * 3600) / 0.5)  # 339 steps
    tau = 10 * 0.5  # now: a save every 10 steps
    assert s.overhead(tau) == pytest.approx(4.0 / tau + (tau / 2 + 10.0) / 3600)
    best = s.overhead(s.young_daly_s)
    assert best == pytest.approx(4.0 / 169.7056 + (169.7056 / 2 + 10.0) / 3600, rel=1e-4)  # about 5%
    advice = s.advice()
    assert "Young–Daly: save every √(2·C·MTBF) = 170s of training = 339 steps" in advice, advice
    assert "expected overhead 80.3%" in advice and "at 339 steps 5.0%" in advice
    assert "To change it: chunk_steps: 339 (and save_freq 0: one save per chunk)" in advice
    assert "MTBF 1.0h (checkpoints.mtbf_hours)" in advice


def test_the_mtbf_observed_from_few_failures_is_flagged(tmp_path):
    write_run(tmp_path / "run")
    events = [json.loads(x) for x in (tmp_path / "run" / layout.EVENTS).read_text().splitlines()]
    assert interruptions(events) == 2  # a2 failed, a3 was killed
    s = save_interval(tmp_path / "run", chunk_steps=20)
    assert s.mtbf_source == "observed" and s.failures == 2
    assert s.mtbf_s == pytest.approx((7200 + 0.5 * 20 + 18 - 0) / 2, rel=0.01)  # wall time / interruptions
    assert "(observed from 2 failure(s), a rough figure)" in s.advice()
    write_run(tmp_path / "calm", killed=False, failed=False)
    assert "no failure yet and no checkpoints.mtbf_hours" in save_interval(tmp_path / "calm", chunk_steps=20).advice()


def test_doctor_and_the_report_say_what_to_set(tmp_path):
    spec = load_spec(
        write_spec(tmp_path, **{"checkpoints.mtbf_hours": 1.0, "chunk_steps": 20, "total_steps": 80}),
        check_environment=False,
    )
    write_run(spec.run_dir("r"))
    finding = doctor.save_interval(Run.of(spec, "r"))
    assert finding is not None and finding.ok and finding.warning, finding
    assert "save every √(2·C·MTBF)" in finding.detail and "nothing changes automatically" in finding.fix
    report = run_report.build(spec.run_dir("r"), spec=spec)
    assert "save interval: a save costs C = 6.00s" in report.summary()  # save_freq 0: each save is a chunk end
