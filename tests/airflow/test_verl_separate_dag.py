"""verl's separate_async trainer resumed lossless, as a DAG: CI's case of the async modes at their own speed.

include/runs/verl_tiny_cpu_lossless.yaml, 4 steps in 2 chunks here, through real Airflow code (`airflow dags test`)
on Ray jobs running verl's TaskRunner and PPOTrainerSeparateAsync.fit(): the rollout in a process of its own (a
logical GPU of its own) generating the next batch while a step trains, given the weights through Relay's gloo
engine; the hf stand-in engine streaming 500 ms a token with long-tail lengths, aborted at every weight update and
going on under the new weights (partial rollouts); verl's own sampler and `wait` bound. Chunk 1's job goes on warm
into chunk 2 and is SIGKILLed there (after step 3, before the checkpoint of step 4): the retry resumes cold from
step 2, whose checkpoint holds verl's queue, saved with the rollout paused, and Relay's ledger.

`relay audit` proves each prompt handed out trained once (or evicted with a reason) within 2 policy versions.
The bitwise proofs of the async modes (the same prompts, versions and weights as a run never stopped) are verl's lane
(tests/airflow/test_verl_async_dag.py, tests/trainers/test_verl_separate_async.py); the lossless colocate_async DAG
and a lossless batch lost in flight, too (tests/airflow/test_verl_lossless_dag.py).

One Ray head of this module's own with 2 logical GPUs (one trains, one generates)."""

from __future__ import annotations

import re

import pytest

from relay.checkpoints import manifest
from relay.checkpoints.gate import admit_dir
from relay.devstack import stack
from relay.insights.audit import audit
from relay.runs import layout
from relay.runs.metrics import SUPERSEDED, read_events, read_jsonl
from relay.runs.prompt_ledger import PROMPTS, PromptLedger
from relay.spec.run_spec import load_spec
from support.helpers import read_metrics, relay_cli
from support.verl_jobs import LOSSLESS_SPEC, dag_spec, dag_with_chunk_2_killed

pytestmark = [pytest.mark.services]

RUN = "ci-lossless"
ENGINE = {"token_latency_ms": 500, "response_lengths": "long_tail"}  # a 32-token answer outlasts a loaded step


@pytest.fixture(scope="module")
def runs(airflow_home, s3_server):
    spec_path = dag_spec(
        LOSSLESS_SPEC,
        airflow_home["runs"],
        "relay_verl_lossless_ray",
        total_steps=4,
        chunk_steps=2,
        settings={"hf_engine": ENGINE},
    )
    run_dir = load_spec(spec_path, check_environment=False).run_dir(RUN)
    with stack.private_ray_head(num_gpus=2) as head:
        returncode, out = dag_with_chunk_2_killed(
            airflow_home,
            "relay_verl_tiny_cpu_lossless",
            RUN,
            run_dir,
            {"AIRFLOW_CONN_RELAY_VERL_LOSSLESS_RAY": head.address},
        )
    return {"run_dir": run_dir, "returncode": returncode, "out": out}


@pytest.mark.fault
def test_the_killed_lossless_chunk_resumes_with_every_prompt_trained_once_within_its_staleness(runs, fault_row):
    assert runs["returncode"] == 0, runs["out"][-6000:]
    run, out = runs["run_dir"], runs["out"]
    assert layout.read_tracker(run) == 4
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    retrained = [r["step"] for r in read_jsonl(run / SUPERSEDED)]
    assert retrained == [3], "the killed try's step 3, trained again"
    starts = [(e["chunk"], e["resumed_from"], e["warm"]) for e in read_events(run) if e["event"] == "chunk_start"]
    assert starts == [(1, 0, False), (2, 2, True), (2, 2, False)]
    restored = re.search(r"restored (\d+) prompt\(s\) in flight at step 2, (all generated|(\d+) to generate again)", out)
    assert restored, out[-6000:]
    if restored.group(3):  # the rollout was generating at the save: verl re-issued exactly those, and Relay checked it
        assert f"verl re-issued the {restored.group(3)} prompt(s) that were generating at the checkpoint" in out

    for step in (2, 4):  # every checkpoint holds verl's queue and Relay's ledger, and passed the gate with them
        folder = layout.step_dir(run, step)
        ledger = PromptLedger.read(folder)
        assert (folder / "transfer_queue").is_dir() and (ledger.exactness, ledger.max_staleness) == ("lossless", 2)
        assert PROMPTS in manifest.read(folder).files and admit_dir(run, step).ok

    result = relay_cli("audit", str(run))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "prompt audit: consistent (lossless): " in result.stdout, result.stdout
    p = audit(run).prompts
    assert p is not None and p.consistent and p.exactness == "lossless"
    assert p.partial > 0, "no response was cut by a weight update and finished under the next weights"
    assert all(s <= 1 for staleness in p.staleness.values() for s in staleness), p.staleness
    fault_row(
        case="async-lossless-kill",
        layer="trainer (verl separate_async, lossless, through the DAG)",
        fault="chunk 1's job, gone on warm into chunk 2, SIGKILLed after step 3 while its rollout generated ahead",
        action="Airflow's retry resumed cold from step 2: verl's queue restored as Relay's ledger listed it, the prompts "
        f"still generating re-issued and checked ({restored.group(3) or 0}); every prompt trained once, "
        f"{p.partial} across a weight update, each within 2 policy versions",
        steps_lost=len(retrained),
        run_dir=run,
    )
