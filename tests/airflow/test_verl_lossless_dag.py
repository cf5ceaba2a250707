"""verl's colocate_async trainer resumed lossless, as a DAG, and a lossless run that loses a batch in flight, in verl's
lane (`./scripts/test.sh --verl`; CI runs the separate_async one, tests/airflow/test_verl_separate_dag.py).

include/runs/verl_tiny_cpu_async.yaml made lossless: its three chunks through real Airflow code on Ray jobs running
PPOTrainerColocateAsync.fit() with verl's own sampler and `wait` bound, the hf stand-in engine streaming 500 ms a
token with long-tail lengths (verl aborts the replicas before each step trains and resumes them after the weight
update: what was generating goes on under the new weights). Chunk 1's job goes on warm into chunk 2 and is SIGKILLed
there after step 3: the retry resumes cold from step 2. `relay audit` proves every prompt trained once within 2
policy versions. Then the same spec through `relay train` 0 -> 3, its save of step 2 losing the oldest generated prompts
in flight, up to a batch (a fault point, as frameworks lose them): `relay audit` fails, naming the dataset rows lost.

One Ray head of this module's own."""

from __future__ import annotations

import re

import pytest

from relay.common.faultpoint import DROP_ENV
from relay.devstack import stack
from relay.insights.audit import audit
from relay.runs import layout
from relay.runs.metrics import SUPERSEDED, read_jsonl
from relay.spec.run_spec import load_spec
from support.helpers import read_metrics, relay_cli
from support.verl_jobs import ASYNC_SPEC, JOB_TIMEOUT, dag_spec, dag_with_chunk_2_killed, relay_train, with_job_env

pytestmark = [pytest.mark.services, pytest.mark.lane("verl")]

RUN = "lane-lossless"
LOSSLESS = {"resume_exactness": "lossless", "hf_engine": {"token_latency_ms": 500, "response_lengths": "long_tail"}}


@pytest.fixture(scope="module")
def runs(airflow_home, s3_server, tmp_path_factory):
    spec_path = dag_spec(ASYNC_SPEC, airflow_home["runs"], "relay_verl_lossless_lane_ray", settings=dict(LOSSLESS))
    run_dir = load_spec(spec_path, check_environment=False).run_dir(RUN)
    base = tmp_path_factory.mktemp("verl_lossless")
    with stack.private_ray_head() as head:
        returncode, out = dag_with_chunk_2_killed(
            airflow_home,
            "relay_verl_tiny_cpu_async",
            RUN,
            run_dir,
            {"AIRFLOW_CONN_RELAY_VERL_LOSSLESS_LANE_RAY": head.address},
        )
        dropping = with_job_env(base / "dropping.yaml", {DROP_ENV: "inflight@2"}, spec_path)
        dropped = base / "dropped" / "run"
        dropped_rc = relay_train(dropped, 3, head.address, base / "dropped.log", dropping).wait(timeout=JOB_TIMEOUT)
    return {
        "run_dir": run_dir,
        "returncode": returncode,
        "out": out,
        "dropped": dropped,
        "dropped_rc": dropped_rc,
        "dropped_out": (base / "dropped.log").read_text(errors="replace"),
    }


@pytest.mark.fault
def test_the_killed_lossless_colocate_chunk_resumes_with_every_prompt_trained_once(runs, fault_row):
    assert runs["returncode"] == 0, runs["out"][-6000:]
    run = runs["run_dir"]
    assert layout.read_tracker(run) == 6 and [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5, 6]
    retrained = [r["step"] for r in read_jsonl(run / SUPERSEDED)]
    assert retrained == [3]
    result = relay_cli("audit", str(run))
    assert result.returncode == 0 and "prompt audit: consistent (lossless): " in result.stdout, result.stdout
    p = audit(run).prompts
    assert p is not None and p.partial > 0, "no response was cut before training and finished under the next weights"
    assert all(s <= 1 for staleness in p.staleness.values() for s in staleness), p.staleness
    fault_row(
        case="async-lossless-kill",
        layer="trainer (verl colocate_async, lossless, through the DAG)",
        fault="chunk 1's job, gone on warm into chunk 2, SIGKILLed after step 3 with responses cut short in flight",
        action="Airflow's retry resumed cold from step 2, verl's queue restored as the ledger listed it, what was "
        f"generating re-issued and checked; every prompt trained once, {p.partial} across a weight update",
        steps_lost=len(retrained),
        run_dir=run,
    )


def test_a_lossless_run_that_loses_a_batch_in_flight_fails_the_audit_naming_its_rows(runs):
    assert runs["dropped_rc"] == 0, runs["dropped_out"][-6000:]
    said = re.search(r"\[relay-fault\] dropped the prompts in flight \[([\d, ]+)\] at step 2", runs["dropped_out"])
    assert said, runs["dropped_out"][-6000:]
    lost = sorted(int(i) for i in said.group(1).split(", "))  # the oldest generated (up to a batch) at the save
    result = relay_cli("audit", str(runs["dropped"]))
    assert result.returncode == 1, result.stdout + result.stderr
    p = audit(runs["dropped"]).prompts
    assert p is not None and sorted(s["index"] for s in p.skipped) == lost and not p.twice, p.summary()
    rows = ", ".join(str(s["index"]) for s in p.skipped)
    assert f"{len(lost)} prompt(s) handed out and never trained (skipped): dataset rows {rows}" in result.stdout
