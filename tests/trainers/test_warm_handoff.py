"""A warm handoff in the CPU trainer's job (relay.runs.handoff, ChunkSession.hand_off): the job that ends a chunk
goes on with the next chunk's steps and commits them only once that chunk's train task admitted it. Each job here
is the Ray job's own entrypoint (`python -m relay.trainers.job`) in a process of its own; this test answers for the
train task through the same files the DAG's task writes.

- A run whose chunks 1 and 2 ran in one warm job (chunks.restart_every 2 then ends it) and chunk 3 in a new
  cold job is bitwise the uninterrupted job's, row by row and weight by weight.
- A warm chunk that is refused, whose previous checkpoint the gate takes away, or that no task admits in time,
  stops with exit code 4 and commits nothing: the tracker still names the chunk it went on from.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relay.insights import goodput
from relay.runs import handoff, layout
from relay.runs.metrics import read_events
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from relay.trainers.contract import ENV_VAR, ChunkRequest
from support.helpers import assert_bitwise_equal, model_state, read_metrics, relay_cli, write_spec

pytestmark = pytest.mark.processes  # trainer jobs in processes of their own: not in the fast lane

TOTAL, CHUNK = 9, 3  # three chunks of three steps


def _spec(folder: Path, **overrides) -> Path:
    return write_spec(folder, name="w", total_steps=TOTAL, chunk_steps=CHUNK, s3=None, **overrides)


def _job(spec_path: Path, run: str, *, chunk: int | None, to_step: int, answer=None, timeout: float = 300, env=None):
    """The chunk's job in a process of its own; `answer(run_dir, record)` plays the next chunk's train task for
    each warm record the job writes. (returncode, output)"""
    spec = load_spec(spec_path, check_environment=False)
    req = ChunkRequest(run=Run.of(spec, run), to_step=to_step, chunk=chunk, attempt=f"job-{run}-{chunk}", handoff=True)
    run_dir = spec.run_dir(run)
    p = subprocess.Popen(
        [sys.executable, "-m", "relay.trainers.job"],
        env={**os.environ, **(env or {}), ENV_VAR: req.to_json()},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    answered: set[int] = set()
    deadline = time.time() + timeout
    while p.poll() is None and time.time() < deadline:
        for k in range(2, TOTAL // CHUNK + 1):
            record = handoff.warm(run_dir, k)
            if answer and k not in answered and record and record["attempt"] == req.attempt:
                answered.add(k)
                answer(run_dir, record)
        time.sleep(0.05)
    if p.poll() is None:
        p.kill()
    out = p.communicate()[0]
    return p.returncode, out


def _admit(run_dir: Path, record: dict) -> None:
    handoff.admit(run_dir, record["chunk"], attempt=record["attempt"], token=record["token"], by="the test's task")


def _starts(run_dir: Path) -> list[tuple]:
    return [(e["chunk"], e["resumed_from"], e["warm"]) for e in read_events(run_dir) if e["event"] == "chunk_start"]


def test_warm_chunks_and_a_restart_are_the_uninterrupted_run_bitwise(tmp_path):
    spec = _spec(tmp_path, **{"chunks.handoff": "warm", "chunks.restart_every": 2})
    rc, out = _job(spec, "straight", chunk=None, to_step=TOTAL)
    assert rc == 0, out[-3000:]
    rc, out = _job(spec, "warm", chunk=1, to_step=CHUNK, answer=_admit)
    assert rc == 0, out[-3000:]
    assert "chunk 2 starts warm from step 3 in this job" in out and "chunk 2 admitted by the test's task" in out
    assert "a fresh one every 2 chunk(s)" in out, "chunks.restart_every ends the job after its second chunk"
    warm_dir = load_spec(spec, check_environment=False).run_dir("warm")
    assert layout.read_tracker(warm_dir) == 2 * CHUNK and handoff.warm(warm_dir, 3) is None
    rc, out = _job(spec, "warm", chunk=3, to_step=TOTAL)
    assert rc == 0, out[-3000:]

    assert _starts(warm_dir) == [(1, 0, False), (2, 3, True), (3, 6, False)]
    ends = [e for e in read_events(warm_dir) if e["event"] == "chunk_end"]
    assert [(e["chunk"], e["end_step"], e.get("handoff")) for e in ends] == [(1, 3, "warm"), (2, 6, None), (3, 9, None)]
    straight_dir = warm_dir.parent / "straight"
    drop = ("chunk", "attempt", "seconds", "time")
    rows = lambda d: [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(d)]  # noqa: E731
    assert rows(warm_dir) == rows(straight_dir), "every step's reward, loss, KL and LR as in one job"
    assert_bitwise_equal(model_state(warm_dir / f"global_step_{TOTAL}"), model_state(straight_dir / f"global_step_{TOTAL}"))

    g = goodput.ledger(warm_dir)
    assert g is not None and abs(sum(g.parts.values()) - g.wall_s) < 1e-6
    assert [(a.chunk, a.warm, a.outcome) for a in g.attempts] == [
        (1, False, "finished"),
        (2, True, "finished"),
        (3, False, "finished"),
    ]
    assert [a.parts.get("startup", 0) > 0 for a in g.attempts] == [True, False, True], "start-up only in new jobs"
    assert g.attempts[1].parts.get("handoff", 0) > 0, "a warm chunk's start is a handoff"


def _refuse(run_dir: Path, record: dict) -> None:
    handoff.refuse(run_dir, record["chunk"], "the settings changed: trainer.settings.optim.lr 0.003 -> 0.01")


def _quarantine(run_dir: Path, record: dict) -> None:
    """What the gate does to a checkpoint that fails validation: set aside, the tracker moved back."""
    aside = layout.relay_dir(run_dir, "quarantine", "global_step_6.test")
    aside.parent.mkdir(parents=True, exist_ok=True)
    layout.step_dir(run_dir, 6).rename(aside)
    layout.write_tracker(run_dir, 3)


@pytest.fixture(scope="module")
def chunk_one(tmp_path_factory) -> Path:
    """Run w's chunk 1, trained cold: the folder every case below copies."""
    cold = _spec(tmp_path_factory.mktemp("cold"))
    rc, out = _job(cold, "w", chunk=1, to_step=CHUNK)
    assert rc == 0, out[-3000:]
    return load_spec(cold, check_environment=False).run_dir("w")


@pytest.mark.parametrize(
    ("case", "answer", "overrides", "tracker", "why"),
    [
        ("refused", _refuse, {}, 6, "it was refused: the settings changed"),
        ("quarantined", _quarantine, {}, 3, "checkpoint 6, which it went on from, is no longer the run's latest"),
        ("not admitted", None, {"chunks.admission_timeout_minutes": 0.01}, 6, "no admission within"),
    ],
)
def test_a_warm_chunk_that_is_not_admitted_commits_nothing(tmp_path, chunk_one, case, answer, overrides, tracker, why):
    spec = _spec(tmp_path, **{"chunks.handoff": "warm", **overrides})
    run_dir = load_spec(spec, check_environment=False).run_dir("w")
    shutil.copytree(chunk_one, run_dir)  # chunk 2 resumes from it and goes on warm into chunk 3

    rc, out = _job(spec, "w", chunk=2, to_step=2 * CHUNK, answer=answer)
    assert rc == 4, out[-3000:]
    assert "chunk 3 starts warm from step 6" in out and why in out, out[-3000:]
    assert "nothing of it was committed" in out
    assert layout.read_tracker(run_dir) == tracker, "the tracker still names what was committed before"
    assert not list(run_dir.glob("global_step_[7-9]")), "no step of the refused chunk was committed"
    assert not any(layout.relay_dir(run_dir, "staging").glob("*")), "nothing left half-written"
    refused = [e for e in read_events(run_dir) if e["event"] == "handoff_refused"]
    assert len(refused) == 1 and refused[0]["chunk"] == 3 and why in refused[0]["why"], refused
    g = goodput.ledger(run_dir)
    assert g is not None and [(a.chunk, a.warm, a.outcome) for a in g.attempts][-2:] == [
        (2, False, "finished"),
        (3, True, "stopped"),
    ]
    assert g.failures[-1].chunk == 3 and g.failures[-1].cause.startswith("stopped: warm chunk not admitted")


@pytest.mark.fault
def test_a_warm_job_killed_while_it_waits_for_its_admission_loses_only_the_warm_chunk(tmp_path, chunk_one, fault_row):
    """Chunk 2's job trains chunk 3 ahead and is SIGKILLed while it waits, at step 9's save, for an admission: nothing
    of chunk 3 is committed or staged, and chunk 3's new job resumes cold from step 6, bitwise the uninterrupted run."""
    spec = _spec(tmp_path, **{"chunks.handoff": "warm"})
    run_dir = load_spec(spec, check_environment=False).run_dir("w")
    shutil.copytree(chunk_one, run_dir)
    rc, out = _job(spec, "straight", chunk=None, to_step=TOTAL)
    assert rc == 0, out[-3000:]

    rc, out = _job(spec, "w", chunk=2, to_step=2 * CHUNK, env={"RELAY_FAULT_KILL_AT": f"awaiting_admission@{TOTAL}"})
    assert rc == -9 and f"waiting for its train task's admission before committing step {TOTAL}" in out, out[-3000:]
    assert layout.read_tracker(run_dir) == 2 * CHUNK and max(layout.step_dirs(run_dir)) == 2 * CHUNK
    staging = layout.relay_dir(run_dir, "staging")
    assert not staging.exists() or not any(staging.iterdir()), "nothing of chunk 3 was staged"

    rc, out = _job(spec, "w", chunk=3, to_step=TOTAL)  # chunk 3's train task: a new job, cold
    assert rc == 0, out[-3000:]
    assert _starts(run_dir)[-2:] == [(3, 6, True), (3, 6, False)]
    straight = run_dir.parent / "straight"
    assert_bitwise_equal(model_state(layout.step_dir(run_dir, TOTAL)), model_state(layout.step_dir(straight, TOTAL)))
    fault_row(
        case="warm-job-killed-waiting",
        fault="chunk 2's job, gone on warm into chunk 3, SIGKILLed while it waits at step 9's save for its admission",
        action="nothing of chunk 3 was committed or staged (the tracker stayed at 6); chunk 3's new job resumed cold "
        "from step 6 and ended bitwise equal to the uninterrupted run",
        steps_lost=CHUNK,  # chunk 3's steps, trained ahead, trained again
        run_dir=run_dir,
    )


def test_a_warm_job_of_an_earlier_incarnation_writes_nothing_into_the_new_one(tmp_path, chunk_one):
    """A fresh start while a warm job waits for its admission (its trainer on another node, where this host cannot
    see it): the job stops as a writer that lost its lease does (exit 3), and nothing of it lands in the new
    incarnation: no event, no row, no checkpoint, no staging folder."""
    import json

    from relay.preflight.prepare import prepare_run
    from relay.runs.lease import Lease

    spec = _spec(tmp_path, **{"chunks.handoff": "warm"})
    loaded = load_spec(spec, check_environment=False)
    run_dir = loaded.run_dir("w")
    shutil.copytree(chunk_one, run_dir)
    fresh = []

    def fresh_start(run_dir: Path, record: dict) -> None:
        lease = Lease(run_dir)
        lease.path.write_text(json.dumps({**lease.current(), "host": "gpu-node-7"}))
        fresh.append(prepare_run(loaded, "w", fresh_start=True, confirm="w", asked_by="DAG run w/again"))

    rc, out = _job(spec, "w", chunk=2, to_step=2 * CHUNK, answer=fresh_start)
    assert rc == 3 and "refusing to write" in out, out[-3000:]
    (state,) = fresh
    assert state.latest_step == 0 and state.archived_to, "the fresh start went on: the old run is in the archive"
    assert read_events(run_dir) == [] and not (run_dir / layout.METRICS).exists()
    assert layout.read_tracker(run_dir) is None and not layout.step_dirs(run_dir)
    staging = layout.relay_dir(run_dir, "staging")
    assert not staging.exists() or not any(staging.iterdir())


def test_chunks_are_warm_by_default_but_relay_train_never_goes_on_into_a_chunk_nothing_admits(tmp_path):
    spec = write_spec(tmp_path, name="w", total_steps=TOTAL, chunk_steps=CHUNK, s3=None, **{"chunks.handoff": None})
    assert load_spec(spec, check_environment=False).warm_chunks
    assert not load_spec(_spec(tmp_path / "cold"), check_environment=False).warm_chunks, "the tests' specs say cold"
    r = relay_cli("train", str(spec), "--to-step", str(CHUNK), "--offline", timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run_dir = load_spec(spec, check_environment=False).run_dir("w")
    assert layout.read_tracker(run_dir) == CHUNK and handoff.warm(run_dir, 2) is None, "the chunk's end ends it"
