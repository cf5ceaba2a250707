"""The goodput ledger (relay.insights.goodput, `relay report --json`): where a run's wall time went and what its
failures cost, from what the run's folder records.

A real run (the CPU trainer through `relay train`) killed after step 8, its last checkpoint at 6, then resumed and
finished: its parts add up to its wall time, it lost the 2 steps the resume superseded, and the failure has a time
to recover. Hand-made events show how the time between attempts is told apart (scheduling in one DAG run, the
wait for a retry, idle between commands) and how overlapping work is counted once.
"""

from __future__ import annotations

import json

import pytest

from relay.common.faultpoint import KILL_ENV
from relay.common.timestamps import event_time
from relay.insights import goodput
from relay.insights import report as run_report
from relay.runs import layout
from relay.runs.metrics import SUPERSEDED, read_jsonl
from support.helpers import relay_cli, write_spec


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A 12-step run in one chunk (checkpoints every 3 steps) killed after step 8's row, resumed from 6 and finished."""
    base = tmp_path_factory.mktemp("goodput")
    spec = write_spec(base, **{"trainer.settings.save_freq": 3, "chunk_steps": 12})
    run_dir = base / "run"
    train = ("train", str(spec), "--checkpoint-dir", str(run_dir), "--offline", "--to-step", "12")
    first = relay_cli(*train, env={KILL_ENV: "after_step@8"})
    assert first.returncode == -9, first.stdout[-2000:] + first.stderr[-2000:]
    again = relay_cli(*train)
    assert again.returncode == 0 and "resumes from step 6" in again.stdout, again.stderr[-2000:]
    return run_dir


def test_a_killed_runs_parts_add_up_and_its_lost_steps_are_the_superseded_rows(killed):
    r = relay_cli("report", str(killed), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)  # the JSON alone on stdout
    g = out["goodput"]
    assert abs(sum(g["parts"].values()) - g["wall_s"]) < 1.0, g["parts"]
    assert set(g["parts"]) == set(goodput.PARTS)
    superseded = read_jsonl(killed / SUPERSEDED)
    assert [row["step"] for row in superseded] == [7, 8]
    assert g["steps_lost"] == len(superseded) == 2 and isinstance(g["steps_lost"], int)
    assert g["steps_kept"] == 12 and out["step"] == 12
    assert g["parts"]["trained_twice"] > 0 and g["parts"]["training"] > 0 and g["parts"]["save"] > 0
    assert g["parts"]["startup"] > 0, "each `relay train` process's start-up counts from its process start"
    assert g["effective_training"] == pytest.approx(g["parts"]["training"] / g["wall_s"], abs=1e-3)

    [failure] = g["failures"]
    assert failure["outcome"] == "killed" and failure["step"] == 8 and failure["steps_lost"] == 2
    assert failure["time_to_recover_s"] > 0, "from the kill to the first new step (9) of the next attempt"
    assert g["failures_n"] == 1 and g["mtbf_s"] == pytest.approx(g["wall_s"], abs=1e-3)
    assert [a["outcome"] for a in g["attempts"]] == ["killed", "finished"]
    assert [(a["steps_kept"], a["steps_lost"]) for a in g["attempts"]] == [(6, 2), (6, 0)]


def test_the_report_shows_the_ledger(killed, tmp_path):
    report = run_report.build(killed)
    assert "goodput " in report.summary() and "1 failure(s): 2 step(s) lost" in report.summary()
    paths = run_report.write(report, tmp_path)
    page = paths["html"].read_text()
    assert 'id="goodput"' in page and 'id="failures"' in page and "<td>killed</td>" in page
    assert paths["png"].stat().st_size > 10_000


def _events(*items) -> list[dict]:
    """(epoch second, event, fields) -> events as Relay writes them."""
    return [{"event": name, "time": event_time(t), **fields} for t, name, fields in items]


def test_gaps_are_told_apart_and_overlaps_counted_once():
    """Chunk 1 (DAG run d1) fails and is retried; chunk 2 publishes chunk 1's checkpoint while it trains; a later
    DAG run trains chunk 3 an hour on."""

    def attempt(t, name, chunk, dag_run, resumed, to, *, end="chunk_end"):
        ev = [
            (t, "phase", {"phase": "task_started", "attempt": name, "chunk": chunk, "dag_run": dag_run}),
            (t + 2, "phase", {"phase": "job_started", "attempt": name, "chunk": chunk}),
            (t + 5, "chunk_start", {"attempt": name, "chunk": chunk, "resumed_from": resumed, "to_step": to}),
        ]
        if end == "chunk_end":
            ev += [
                (t + 16, "checkpoint", {"attempt": name, "step": to, "seconds": 1.0}),
                (t + 16.5, "chunk_end", {"attempt": name, "chunk": chunk, "end_step": to}),
                (t + 18, "phase", {"phase": "job_ended", "attempt": name, "chunk": chunk}),
            ]
        else:
            ev += [(t + 18, "chunk_failed", {"attempt": name, "chunk": chunk, "cause": "exception", "step": 2})]
        return [*ev, (t + 20, "phase", {"phase": "task_done", "attempt": name, "chunk": chunk})]

    events = _events(
        *attempt(0, "a1", 1, "d1", 0, 5, end="failed"),
        *attempt(50, "a2", 1, "d1", 0, 5),
        (76, "validation", {"step": 5, "seconds": 2.0}),
        *attempt(80, "a3", 2, "d1", 5, 10),
        (110, "publish", {"step": 5, "seconds": 40.0}),  # 70..110: overlaps a3 until its end at 100
        *attempt(3700, "a4", 3, "d2", 10, 15),
    )
    rows = [
        {"step": s, "attempt": a, "time": t0 + 10 + 1.0 * k, "seconds": 1.0}
        for a, t0, steps in (("a2", 50, range(1, 6)), ("a3", 80, range(6, 11)), ("a4", 3700, range(11, 16)))
        for k, s in enumerate(steps, 1)
    ]
    lost = [{"step": s, "attempt": "a1", "time": 10 + 1.0 * k, "seconds": 1.0} for k, s in enumerate((1, 2), 1)]
    g = goodput.build(events, rows, lost)
    assert g is not None and g.wall_s == pytest.approx(3720)
    assert sum(g.parts.values()) == pytest.approx(g.wall_s)
    p = g.parts
    assert p["retry_wait"] == pytest.approx(30), "a1's task ended at 20, a2's began at 50"
    assert p["submission"] == pytest.approx(4 * 2) and p["startup"] == pytest.approx(4 * 8)
    assert p["trained_twice"] == pytest.approx(2) and p["training"] == pytest.approx(15)
    assert p["save"] == pytest.approx(3) and p["validation"] == pytest.approx(2)
    assert p["publication"] == pytest.approx(10), "only 100..110: before that chunk 2's own parts count"
    assert p["idle"] == pytest.approx(3700 - 110), "the next DAG run starts an hour later"
    assert p["scheduling"] == pytest.approx(4 + 4), "70..74 and 76..80: publishing then, but chunk 2 waited on Airflow"
    assert p["teardown"] == pytest.approx(8 + 3 * 4), "a1: its last row to its task's end; the others: save to task end"
    assert [f.attempt for f in g.failures] == ["a1"] and g.failures[0].cause == "exception"
    assert g.failures[0].time_to_recover_s == pytest.approx((50 + 10 + 2) - 20), "to step 3's start in a2"
    assert [c["chunk"] for c in g.chunks()] == [1, 2, 3] and g.chunks()[0]["attempts"] == 2


def test_no_attempt_no_ledger(tmp_path):
    assert goodput.ledger(tmp_path) is None
    (tmp_path / layout.EVENTS).write_text(json.dumps({"event": "freeze", "time": event_time()}) + "\n")
    assert goodput.ledger(tmp_path) is None


def test_an_elastic_runs_wait_for_nodes_and_time_below_its_largest_world_size_are_counted():
    """Chunk 1 waits 30 s for nodes (below its minimum) inside its train task, then trains at world size 2; chunk 2's
    retry after a lost node trains at 1; chunk 3 grows back to 2."""

    def attempt(t, name, chunk, size, resumed, to):
        return [
            (t, "phase", {"phase": "job_started", "attempt": name, "chunk": chunk}),
            (
                t + 5,
                "chunk_start",
                {"attempt": name, "chunk": chunk, "resumed_from": resumed, "to_step": to, "world_size": size},
            ),
            (t + 16.5, "chunk_end", {"attempt": name, "chunk": chunk, "end_step": to}),
            (t + 18, "phase", {"phase": "job_ended", "attempt": name, "chunk": chunk}),
        ]

    events = _events(
        (0, "phase", {"phase": "task_started", "attempt": "a1", "chunk": 1, "dag_run": "d"}),
        (1, "capacity_wait", {"chunk": 1, "below_minimum": True}),
        (31, "world_size", {"chunk": 1, "world_size": 2, "largest": 2, "waited_s": 30.0}),
        *attempt(32, "a1", 1, 2, 0, 5),
        *attempt(60, "a2", 2, 1, 5, 10),
        *attempt(90, "a3", 3, 2, 10, 15),
    )
    g = goodput.build(events, [], [])
    assert g is not None and sum(g.parts.values()) == pytest.approx(g.wall_s)
    assert g.parts["capacity_wait"] == pytest.approx(30), "the wait for nodes, not the train task's submission"
    assert g.parts["submission"] == pytest.approx(1 + 1), "before the wait, and after it until the job ran"
    assert [(w, round(e - s)) for s, e, w in g.world_sizes] == [(2, 28), (1, 30), (2, 13)]
    assert g.largest_world_size == 2 and g.below_largest_s == pytest.approx(30)
    assert "below its largest world size (2) for 30s" in g.summary(), g.summary()
    assert g.to_dict()["world_size"]["below_largest_s"] == pytest.approx(30)
