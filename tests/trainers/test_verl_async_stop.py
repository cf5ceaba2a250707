"""verl's colocate_async trainer stopped gracefully during its warm-up, and a batch in flight lost at a save (the lane
of `./scripts/test.sh --verl`, marked lane("verl")): include/runs/verl_tiny_cpu_async.yaml through `relay train`.

A run SIGTERMed in step 1 (the warm-up batch and the next in flight) saves step 1 with the second batch in flight and
its resume loses nothing: its first two steps are the uninterrupted run's. The same run then losing its batch in
flight at step 2's save (a fault point, as frameworks lose it) fails `relay audit`, which names the prompts lost:
those the uninterrupted run trains at step 3. The uninterrupted run: one job 0 -> 3.

The DAG of this spec, killed and retried by Airflow, is CI's (tests/airflow/test_verl_async_dag.py). Three verl jobs
on a Ray head of this module's own."""

from __future__ import annotations

import signal

import pytest

from relay.common.faultpoint import DROP_ENV
from relay.devstack import stack
from relay.runs import layout
from relay.runs.prompt_ledger import PromptLedger
from support.helpers import read_metrics, relay_cli
from support.verl_jobs import ASYNC_SPEC, JOB_TIMEOUT, finish, relay_train, stopped_gracefully, with_job_env

pytestmark = pytest.mark.lane("verl")

PER_STEP = ("sample_indices", "prompt_seqs", "policy_versions", "handed_out_seqs", "lr", "reward_mean")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`relay train` 0 -> 2 SIGTERMed in step 1 (held at its end until then), then `relay train` 1 -> 3 losing the
    batch in flight at step 2's save; and one job 0 -> 3, on the same head."""
    base = tmp_path_factory.mktemp("verl_async_stop")
    faulted, straight = base / "faulted" / "run", base / "straight" / "run"
    with stack.private_ray_head() as head:
        stopped_rc = stopped_gracefully(faulted, 1, 2, head.address, base, ASYNC_SPEC)
        stopped_tracker = layout.read_tracker(faulted)
        in_flight_at_1 = PromptLedger.read(layout.step_dir(faulted, 1)).live if stopped_tracker == 1 else {}
        dropping = with_job_env(base / "dropping.yaml", {DROP_ENV: "inflight@2"}, ASYNC_SPEC)
        dropped_rc = relay_train(faulted, 3, head.address, base / "dropped.log", dropping).wait(timeout=JOB_TIMEOUT)
        finish(relay_train(straight, 3, head.address, base / "straight.log", ASYNC_SPEC), base / "straight.log")
    return {
        "faulted": faulted,
        "straight": straight,
        "stopped_rc": stopped_rc,
        "stopped_tracker": stopped_tracker,
        "in_flight_at_1": in_flight_at_1,
        "dropped_rc": dropped_rc,
        "out": (base / "stopped-at-1.log").read_text(errors="replace") + (base / "dropped.log").read_text(errors="replace"),
    }


def test_a_graceful_stop_in_the_warm_up_loses_nothing_and_a_dropped_batch_fails_the_audit(runs):
    """The stop saved step 1 with the batch handed out in step 1 in flight (generated, not trained); the resume trained
    it at step 2 as the uninterrupted run does. The job that then lost its batch in flight at step 2's save trained
    another at step 3: `relay audit` fails, naming the dataset rows of the prompts lost."""
    out = runs["out"]
    assert runs["stopped_rc"] == 128 + signal.SIGTERM and runs["stopped_tracker"] == 1, out[-6000:]
    assert sorted(p.seq for p in runs["in_flight_at_1"].values()) == [4, 5, 6, 7]
    assert runs["dropped_rc"] == 0, out[-6000:]
    rows, base = read_metrics(runs["faulted"]), read_metrics(runs["straight"])
    for key in PER_STEP:
        assert [r[key] for r in rows[:2]] == [r[key] for r in base[:2]], key
    lost = base[2]["sample_indices"]  # what the uninterrupted run trains at step 3: in flight at step 2's save
    assert "[relay-fault] dropped the prompts in flight" in out
    result = relay_cli("audit", str(runs["faulted"]))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"4 prompt(s) handed out and never trained (skipped): dataset rows {', '.join(map(str, lost))}" in (
        result.stdout
    ), result.stdout
    assert "step 3: staleness ['0'], a run never stopped has 1" in result.stdout
