"""verl's own trainer, end to end on a CPU: `relay train` of include/runs/verl_tiny_cpu.yaml as Ray jobs on the
session's head, through verl's TaskRunner, PPOTrainerSync.fit(), its FSDP engine, reference model, GRPO
advantage and FSDPCheckpointManager; the transformers rollout (hf) stands in for vLLM only.

One file, run by one xdist worker (--dist loadfile): its jobs run one after another, as verl's jobs each hold
the head's logical GPU. Together they take a few minutes: each job starts Ray actors and imports verl and torch
in several processes.

- an uninterrupted job trains 0 -> 4;
- a chunked run: a job 0 -> 2; a job 2 -> 4 whose driver is SIGKILLed after step 3 and before its checkpoint;
  `relay train` again resumes from step 2, is SIGTERMed in step 3 and stops gracefully (the actor saves step 3
  through verl's own save path); `relay train` again resumes from step 3 and finishes at 4;
- the two runs have every step once, the same LR, the same data order (dataset indices per step), the same
  resume point; whether their final weights are bitwise equal is asserted (the hf rollout seeds each response
  from the seed, the step and the sample, and verl restores every RNG it saves);
- every checkpoint passes the gate at every level, the smoke check included.
- saves off the critical path (checkpoints.async_save) with verl's worker SIGKILLed while it writes step 4's shards:
  step 2 stays the latest, and `relay train` again resumes from it and ends with the uninterrupted run's weights.
"""

from __future__ import annotations

import signal

import pytest
import yaml

from relay.checkpoints.gate import admit_dir
from relay.common.faultpoint import KILL_ENV
from relay.runs import layout
from relay.runs.metrics import SUPERSEDED, read_events, read_jsonl
from relay.runs.phases import STARTUP, phase_marks
from relay.spec.run_spec import load_spec
from support.helpers import assert_bitwise_equal, model_state, read_metrics
from support.verl_jobs import (
    JOB_TIMEOUT,
    SPEC,
    finish,
    relay_train,
    stopped_gracefully,
    two_chunks_with_a_kill,
    with_job_env,
)


def E2E(test):
    """The tests of the runs: verl's lane, ./scripts/test.sh --verl (tests/conftest.py: LANES), on the session's Ray head."""
    return pytest.mark.services(pytest.mark.lane("verl")(test))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ray_address):
    base = tmp_path_factory.mktemp("verl_cpu")
    straight, chunked = base / "straight" / "run", base / "chunked" / "run"

    # The uninterrupted run: one job, 0 -> 4.
    finish(relay_train(straight, 4, ray_address, base / "straight.log"), base / "straight.log")

    # The chunked run: 0 -> 2; then 2 -> 4, its driver SIGKILLed after step 3, before the checkpoint of step 4
    # (and 20 s, longer than a step, to see that nothing commits step 4).
    killed_log = two_chunks_with_a_kill(chunked, ray_address, base, settle_s=20)

    # The retry resumes from step 2, and is stopped gracefully in step 3: `relay train` gets SIGTERM and stops its
    # job (Ray's SIGTERM, its SIGKILL only after the spec's stop grace); the driver passes the stop on to verl's
    # actor, held at the end of step 3 until then, which saves step 3 through verl's own save path and ends.
    assert stopped_gracefully(chunked, 3, 4, ray_address, base) == 128 + signal.SIGTERM
    stopped_log = (base / "stopped-at-3.log").read_text(errors="replace")
    assert layout.read_tracker(chunked) == 3, stopped_log[-6000:]

    # And the rest: `relay train` again resumes from step 3, the graceful stop's checkpoint.
    retry = finish(relay_train(chunked, 4, ray_address, base / "c4.log"), base / "c4.log")
    return {
        "straight": straight,
        "chunked": chunked,
        "killed_log": killed_log,
        "stopped_log": stopped_log,
        "retry_log": retry,
    }


@E2E
def test_a_killed_verl_chunk_resumes_and_every_step_is_trained_once(runs):
    straight, chunked = runs["straight"], runs["chunked"]
    assert layout.read_tracker(straight) == 4 and layout.read_tracker(chunked) == 4
    rows, base = read_metrics(chunked), read_metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] == [r["step"] for r in base]
    superseded = read_jsonl(chunked / SUPERSEDED)
    assert [r["step"] for r in superseded] == [3], "the killed attempt's step 3 is kept aside, trained again"
    starts = [e for e in read_events(chunked) if e["event"] == "chunk_start"]
    assert [e["resumed_from"] for e in starts] == [0, 2, 2, 3]
    assert "resumes from step 3" in runs["retry_log"] and "verl resumed at step 3" in runs["retry_log"]


@E2E
def test_a_sigtermed_verl_chunk_saves_its_step_through_verls_save_and_loses_none(runs):
    """The graceful stop of the retry: step 3 saved by verl's own save path in the actor, the job ended with
    StoppedEarly (cause preempted), and the next chunk resumed from step 3 with no step trained twice."""
    chunked, log = runs["chunked"], runs["stopped_log"]
    stops = [e for e in read_events(chunked) if e["event"] == "chunk_stopped"]
    assert [(e["step"], e["reason"]) for e in stops] == [(3, "a stop request (SIGTERM)")], stops
    assert "stopping after step 3 (a stop request (SIGTERM)): its checkpoint is committed" in log, log[-6000:]
    assert "stopped early: stopped after step 3" in log
    assert "[relay] cause: preempted (StoppedEarly; a retry can help)" in log
    assert "interrupted (SIGTERM)" in log
    superseded = [r["step"] for r in read_jsonl(chunked / SUPERSEDED)]
    assert superseded == [3], "only the SIGKILLed attempt's step 3: the graceful stop lost none"


@E2E
def test_the_resumed_run_has_the_uninterrupted_runs_lr_and_data_order(runs):
    rows, base = read_metrics(runs["chunked"]), read_metrics(runs["straight"])
    assert [r["lr"] for r in rows] == [r["lr"] for r in base]
    assert all(r["sample_indices"] for r in rows)
    assert [r["sample_indices"] for r in rows] == [r["sample_indices"] for r in base]


@E2E
def test_the_resumed_run_ends_with_the_uninterrupted_runs_weights_bit_for_bit(runs):
    straight = model_state(layout.step_dir(runs["straight"], 4))
    chunked = model_state(layout.step_dir(runs["chunked"], 4))
    assert_bitwise_equal(chunked, straight)
    rows, base = read_metrics(runs["chunked"]), read_metrics(runs["straight"])
    assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in base]


@E2E
def test_the_weights_moved(runs):
    """A GRPO step with an uneven reward changes the policy (an all-zero advantage would not)."""
    first = model_state(layout.step_dir(runs["chunked"], 2))
    last = model_state(layout.step_dir(runs["chunked"], 4))
    assert any(not (first[k] == last[k]).all() for k in first)
    assert any(r["reward_mean"] > 0 for r in read_metrics(runs["chunked"]))


@E2E
def test_verls_checkpoints_pass_the_gate_at_every_level_with_the_smoke_check(runs):
    from relay.preflight.admission import smoke_check

    spec = load_spec(SPEC)
    assert spec.checkpoints.smoke
    for run_dir in (runs["straight"], runs["chunked"]):
        for step in (2, 4) if run_dir == runs["chunked"] else (4,):
            admission = admit_dir(run_dir, step, smoke=smoke_check(spec))
            assert admission.ok, admission.explain()
            assert "forward pass" in admission.explain()


@E2E
def test_each_verl_chunk_records_its_start_up_phases(runs):
    events = read_events(runs["chunked"])
    attempts = [e["attempt"] for e in events if e["event"] == "chunk_start"]
    resumed = phase_marks(events, attempts[-1])
    assert list(resumed) == list(STARTUP), resumed


def test_the_chunk_trainer_is_verls_own_loop():
    """Everything but the chunk's edges is verl's: a stand-in for fit, step or the workers fails here."""
    from verl.trainer.main_ppo import TaskRunnerV1
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from relay.trainers.verl_ppo import chunk_trainer  # verl: imported by this test, not at collection
    from relay.trainers.verl_ppo.runner import relay_task_runner
    from relay.trainers.verl_ppo.verl_contract import original_class

    cls = chunk_trainer.RelayChunkTrainer
    assert issubclass(cls, PPOTrainerSync)
    for name in (
        "fit",
        "step",
        "_step_once",
        "_setup",
        "_compute_advantage",
        "_compute_ref_log_prob",
        "_compute_old_log_prob",
        "_update_actor",
        "_compute_reward_colocate",
        "init",
    ):
        assert getattr(cls, name) is getattr(PPOTrainer, name), name
    assert cls.on_sample_end is PPOTrainerSync.on_sample_end
    # (Relay's own: the chunk's edges, the batch's order, the metrics row, the graceful stop after a step; each
    # calls verl's method: on_step_end, for one, hands the weights to the rollout as verl's does, and saves through
    # verl's _save_checkpoint when asked to stop)
    assert cls.on_step_end is not PPOTrainerSync.on_step_end and cls._save_checkpoint.__qualname__.startswith("RelayChunk.")
    # verl's async trainer under the same edges: its warm-up, its fully async client and its abort are verl's
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync

    acls = chunk_trainer.RelayColocateAsyncTrainer
    for name in ("fit", "_step_once", "_setup", "_update_actor", "_compute_advantage", "init", "_load_checkpoint"):
        assert getattr(acls, name) is getattr(cls, name), name
    assert acls.get_llm_client is PPOTrainerColocateAsync.get_llm_client
    assert acls._add_async_warmup_batches is PPOTrainer._add_async_warmup_batches
    runner = relay_task_runner()
    assert issubclass(runner, original_class(TaskRunnerV1))
    assert runner.init_agent_loop_manager is original_class(TaskRunnerV1).init_agent_loop_manager


@pytest.fixture(scope="module")
def async_crash(tmp_path_factory, ray_address):
    """Saves off the critical path in verl's workers (checkpoints.async_save), the worker SIGKILLed on its save thread
    while it writes step 4's shards (training has gone on; step 4 ends the job, which waits for that save); then
    `relay train` again."""
    base = tmp_path_factory.mktemp("verl_async_crash")
    spec = with_job_env(base / "spec.yaml", {KILL_ENV: "mid_save@4", "RELAY_FAULT_ONCE": str(base / "killed-once")})
    d = yaml.safe_load(spec.read_text())
    d["checkpoints"]["async_save"] = True
    spec.write_text(yaml.safe_dump(d, sort_keys=False))
    run = base / "run"
    crashed = relay_train(run, 4, ray_address, base / "crashed.log", spec=spec).wait(timeout=JOB_TIMEOUT)
    after_crash = {"tracker": layout.read_tracker(run), "step_4": (run / "global_step_4").exists()}
    retry = finish(relay_train(run, 4, ray_address, base / "retry.log", spec=spec), base / "retry.log")
    return {
        "run": run,
        "crashed_rc": crashed,
        "crashed_log": (base / "crashed.log").read_text(errors="replace"),
        "after_crash": after_crash,
        "retry_log": retry,
    }


@E2E
def test_a_worker_killed_while_writing_an_async_save_leaves_the_checkpoint_before_it(async_crash):
    """The killed worker's step 4 is never committed: the job fails, the tracker still names step 2 and no
    global_step_4 exists; `relay train` again resumes from step 2 (certified) and commits step 4."""
    log = async_crash["crashed_log"]
    assert async_crash["crashed_rc"] != 0, log[-6000:]
    assert "[relay-fault] killed at mid_save step 4" in log, log[-6000:]
    assert async_crash["after_crash"] == {"tracker": 2, "step_4": False}, log[-6000:]
    saves = [e for e in read_events(async_crash["run"]) if e["event"] == "checkpoint"]
    assert [(e["step"], "written_seconds" in e) for e in saves] == [(2, True), (4, True)], saves
    assert "resumes from step 2" in async_crash["retry_log"]
    assert "certified resume from step 2" in async_crash["retry_log"]
    assert layout.read_tracker(async_crash["run"]) == 4


@E2E
def test_async_saves_and_a_crash_in_one_end_with_the_uninterrupted_runs_weights(async_crash, runs):
    assert_bitwise_equal(
        model_state(layout.step_dir(async_crash["run"], 4)), model_state(layout.step_dir(runs["straight"], 4))
    )
