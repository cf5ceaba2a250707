"""verl's own trainer in CI: two chunks of include/runs/verl_tiny_cpu.yaml through verl's TaskRunner and
PPOTrainerSync.fit() (its FSDP engine, reference model, GRPO advantage, FSDPCheckpointManager; the hf rollout
stands in for vLLM only), each chunk a Ray job submitted by `relay train` as a user runs it; chunk 2's job is
SIGKILLed mid-chunk and `relay train` again resumes it from chunk 1's checkpoint.

The three jobs of the proof, and no more: the comparison with an uninterrupted run, the graceful stop and
the bit-for-bit weights are verl's own lane (tests/trainers/test_verl_cpu_fit.py, `./scripts/test.sh --verl`),
whose five jobs do not fit in CI's 30 minutes on the 2-core machine. Here the step trained twice is compared
with its first try (relay.runs.audit): the same reward, loss, KL, LR and data order to the bit.

The jobs run on a Ray head of this module's own (relay.devstack.stack.private_ray_head, as `relay train`
starts one with nothing running): a verl chunk holds more logical CPUs and a logical GPU than the session's
head (2 CPUs, for the suite's many small chunk jobs) gives."""

from __future__ import annotations

import pytest

from relay.checkpoints.gate import admit_dir, smoke_check
from relay.devstack import stack
from relay.runs import layout
from relay.runs.audit import audit
from relay.runs.metrics import SUPERSEDED, read_events, read_jsonl
from relay.runs.phases import STARTUP, phase_marks
from relay.runs.spec import load_spec
from support.helpers import model_state, read_metrics
from support.verl_jobs import SPEC, finish, relay_train, two_chunks_with_a_kill

pytestmark = pytest.mark.services  # S3 is not used (--offline), but Ray is: never in the fast lane


@pytest.fixture(scope="module")
def chunked(tmp_path_factory):
    base = tmp_path_factory.mktemp("verl_chunks")
    run = base / "run"
    with stack.private_ray_head() as head:
        # Chunk 1 (0 -> 2); chunk 2 (2 -> 4), its driver SIGKILLed after step 3's row, before step 4's checkpoint.
        killed_log = two_chunks_with_a_kill(run, head.address, base, settle_s=10)
        # The retry: `relay train` again, as Airflow's retry of the chunk's task submits it again.
        retry_log = finish(relay_train(run, 4, head.address, base / "c3.log"), base / "c3.log")
    return {"run": run, "killed_log": killed_log, "retry_log": retry_log}


def test_the_killed_chunk_resumes_from_the_latest_checkpoint_and_trains_every_step_once(chunked):
    run = chunked["run"]
    assert layout.read_tracker(run) == 4
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    assert [r["step"] for r in read_jsonl(run / SUPERSEDED)] == [3], "the killed try's step 3, trained again"
    starts = [e for e in read_events(run) if e["event"] == "chunk_start"]
    assert [e["resumed_from"] for e in starts] == [0, 2, 2]
    assert "resumes from step 2" in chunked["retry_log"] and "verl resumed at step 2" in chunked["retry_log"]
    assert all(r["lr"] is not None and r["sample_indices"] for r in read_metrics(run))


def test_the_step_trained_twice_equals_its_first_try(chunked):
    """verl's generation is seeded per sample and verl restores every RNG it saves: the resumed step 3 repeats
    the killed try's step 3 bit for bit, every logged metric (reward, loss, KL, LR, the dataset indices)."""
    report = audit(chunked["run"])
    assert report.steps == [3] and report.consistent, report.summary()
    first = read_jsonl(chunked["run"] / SUPERSEDED)[0]
    assert {"lr", "sample_indices", "reward_mean"} <= set(first)


def test_the_weights_moved_and_every_checkpoint_passes_the_gate_with_the_smoke_check(chunked):
    run = chunked["run"]
    before, after = model_state(layout.step_dir(run, 2)), model_state(layout.step_dir(run, 4))
    assert any(not (before[k] == after[k]).all() for k in before), "GRPO with an uneven reward moves the policy"
    spec = load_spec(SPEC)
    for step in (2, 4):
        admission = admit_dir(run, step, smoke=smoke_check(spec))
        assert admission.ok, admission.explain()
        assert "forward pass" in admission.explain()


def test_each_verl_chunk_records_its_start_up_phases(chunked):
    events = read_events(chunked["run"])
    attempts = [e["attempt"] for e in events if e["event"] == "chunk_start"]
    assert list(phase_marks(events, attempts[-1])) == list(STARTUP)
