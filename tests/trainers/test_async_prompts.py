"""The async chunk trainer's checks of the prompts in flight (relay.trainers.verl_ppo.async_trainer), on the ledger a
save wrote and TransferQueue's listing after verl's load (stood in: the queue itself needs verl's Ray actors; the DAG
tests run the real one, tests/airflow/test_verl_separate_dag.py in CI), its choice of prompts in both exactness modes,
the evictions it records and the re-issue at a lossless resume it checks."""

from __future__ import annotations

import types

import pytest

from relay.runs import layout
from relay.runs.prompt_ledger import PromptLedger


class Refused(Exception):
    pass


def trainer_at(tmp_path, monkeypatch, queue: dict, *, lossless=False):
    """Relay's colocate_async trainer after verl's load of step 4, whose ledger held u0..u3 in flight; `queue`: the
    restored listing."""
    from relay.trainers.verl_ppo import async_trainer, chunk_trainer

    ledger = PromptLedger()
    ledger.hand_out([f"u{i}" for i in range(4)], [10, 11, 12, 13], 4)
    layout.step_dir(tmp_path, 4).mkdir(parents=True)
    ledger.write(layout.step_dir(tmp_path, 4), 4, 1)
    cleared = []
    monkeypatch.setattr(async_trainer, "_train_items", lambda: dict(queue))
    monkeypatch.setattr(async_trainer.tq, "kv_clear", lambda keys, partition_id: cleared.extend(keys))
    t = chunk_trainer.RelayColocateAsyncTrainer.__new__(chunk_trainer.RelayColocateAsyncTrainer)
    t.relay = types.SimpleNamespace(run_dir=str(tmp_path))
    t.relay_session = types.SimpleNamespace(refuse_resume=lambda check, detail: Refused(check, detail))
    t._relay_lossless, t._relay_bound = lossless, 2 if lossless else None
    t._relay_reissue_due = []
    return t, cleared


def finished(uid: str) -> dict:
    return {uid: {"is_prompt": True, "status": "finished"}, f"{uid}_0_0": {"status": "success"}}


def test_a_resume_with_every_prompt_in_flight_restored_goes_on_and_the_trained_batchs_leftovers_are_cleared(
    tmp_path, monkeypatch
):
    queue = {k: v for i in range(4) for k, v in finished(f"u{i}").items()}
    queue["old_0_0"] = {"status": "success"}  # the step's own batch, saved before verl cleared it
    t, cleared = trainer_at(tmp_path, monkeypatch, queue)
    t._relay_after_load(4)
    assert sorted(t._relay_ledger.live) == ["u0", "u1", "u2", "u3"] and t._relay_ledger.next_seq == 4
    assert cleared == ["old_0_0"]


@pytest.mark.parametrize(
    "queue, said",
    [
        ({}, "missing from verl's transfer_queue/: dataset rows [10, 11, 12, 13]"),  # verl skips a missing folder
        ({k: v for i in (0, 1, 2) for k, v in finished(f"u{i}").items()}, "dataset rows [13]"),
        (
            {**{k: v for i in range(4) for k, v in finished(f"u{i}").items()}, "x": {"is_prompt": True}},
            "1 in the queue that the ledger does not hold",
        ),
        (
            {
                **{k: v for i in range(3) for k, v in finished(f"u{i}").items()},
                "u3": {"is_prompt": True, "status": "running"},
            },
            "1 still generating",
        ),
    ],
)
def test_a_resume_whose_queue_is_not_the_ledgers_is_refused_naming_what_differs(tmp_path, monkeypatch, queue, said):
    t, _ = trainer_at(tmp_path, monkeypatch, queue)
    with pytest.raises(Refused) as e:
        t._relay_after_load(4)
    check, detail = e.value.args
    assert check == "prompts_in_flight" and said in detail and "would skip or repeat them" in detail


def test_the_sampler_takes_the_oldest_prompts_handed_out_not_the_first_to_finish():
    from relay.trainers.verl_ppo.async_trainer import FirstInFirstOut

    ledger = PromptLedger()
    ledger.hand_out(["late", "early", "mid"], [3, 1, 2], 1)  # numbered 0, 1, 2 in the order handed out
    buffer = FirstInFirstOut.__new__(FirstInFirstOut)
    buffer.partitions, buffer.prompt_global_steps = {"train": {}}, {"train": {}}
    buffer.prompt_order, buffer.on_evicted = ledger.order, ledger.evict
    chosen, _, _ = buffer._select_prompt_uids("train", {"mid", "early", "late"}, 2)
    assert chosen == ["late", "early"]
    from relay.common.errors import RelayError

    with pytest.raises(RelayError, match="never handed out"):
        buffer._select_prompt_uids("train", {"mid", "stranger"}, 1)


def test_lossless_takes_verls_own_choice_the_oldest_step_among_the_finished():
    from relay.trainers.verl_ppo.async_trainer import FirstInFirstOut

    ledger = PromptLedger()
    ledger.hand_out(["a", "b", "c"], [1, 2, 3], 1)
    buffer = FirstInFirstOut.__new__(FirstInFirstOut)
    buffer.partitions = {"train": {}}
    buffer.prompt_global_steps = {"train": {"a": 3, "b": 1, "c": 2}}  # c was re-issued at a resume: step 2
    buffer.prompt_order, buffer.on_evicted, buffer.verls_order = ledger.order, ledger.evict, True
    chosen, _, _ = buffer._select_prompt_uids("train", {"a", "b", "c"}, 2)
    assert chosen == ["b", "c"]


def test_every_eviction_verl_makes_leaves_the_ledger_with_its_reason_in_the_steps_row(monkeypatch):
    from collections import Counter, defaultdict

    from verl.trainer.ppo.v1 import replay_buffer

    from relay.trainers.verl_ppo.async_trainer import FirstInFirstOut

    cleared = []
    monkeypatch.setattr(replay_buffer.tq, "kv_clear", lambda partition_id, keys: cleared.extend(keys))
    ledger = PromptLedger()
    ledger.hand_out(["f", "s", "d", "kept"], [5, 6, 7, 8], 1)
    buffer = FirstInFirstOut.__new__(FirstInFirstOut)
    buffer.partitions = defaultdict(dict, {"train": {"f_0_0": {}, "s_0_0": {}, "kept_0_0": {}}})
    for name in ("pending_keys", "running_keys", "finished_keys", "failure_keys"):
        setattr(buffer, name, defaultdict(set))
    buffer.prompt_global_steps = defaultdict(dict, {"train": {"f": 1, "s": 1, "d": 1, "kept": 1}})
    buffer._dapo_classification_cache = defaultdict(dict)
    buffer.prompt_order, buffer.on_evicted = ledger.order, ledger.evict
    evicted, *_ = buffer._evict_terminal_groups(4, "train", ({"s"}, {"d"}, {"f"}, Counter()))
    assert evicted == {"f", "s", "d"} and set(cleared) == {"f", "s", "d", "f_0_0", "s_0_0"}
    assert list(ledger.live) == ["kept"]
    row = ledger.row_fields()
    reasons = dict(zip(row["evicted_indices"], row["evicted_reasons"], strict=True))
    assert reasons == {5: "rollout_failure", 6: "stale", 7: "filtered"}
    assert "evicted_seqs" not in ledger.row_fields()  # said once, in the row of the step that evicted them


def test_a_lossless_resume_lets_verl_reissue_exactly_the_prompts_still_generating(tmp_path, monkeypatch):
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    queue = {
        **{k: v for i in range(3) for k, v in finished(f"u{i}").items()},
        "u3": {"is_prompt": True, "status": "running", "global_steps": 4},
        "u3_0_0": {"status": "success"},  # a session it finished before the save: verl generates the group again
    }
    t, _ = trainer_at(tmp_path, monkeypatch, queue, lossless=True)
    t._relay_after_load(4)  # bitwise would refuse it ("1 still generating")
    assert t._relay_reissue_due == ["u3"]
    t.global_steps = 5

    def verls(self, partition_id="train", reissue=("u3",)):
        for uid in reissue:
            queue[uid] = {**queue[uid], "status": "pending", "global_steps": self.global_steps}
        return len(reissue)

    monkeypatch.setattr(PPOTrainer, "_reissue_inflight_prompts", verls)
    assert t._reissue_inflight_prompts() == 1
    assert t._relay_ledger.row_fields()["reissued_seqs"] == [3]

    t._relay_reissue_due = ["u3"]
    monkeypatch.setattr(PPOTrainer, "_reissue_inflight_prompts", lambda self, partition_id="train": 0)
    with pytest.raises(Refused) as e:
        t._reissue_inflight_prompts()
    assert "verl re-issued 0 prompt(s) at step 5, the checkpoint had 1 still generating" in e.value.args[1]


@pytest.mark.parametrize(
    "mode, lossless, paused_by_verl, pauses",
    [
        ("separate_async", True, False, ["standalone.abort", "saved", "standalone.resume"]),
        ("colocate_async", True, True, ["saved"]),  # a save inside a step: verl aborted its replicas for training
        ("colocate_async", True, False, ["hybrid.abort", "saved", "hybrid.resume"]),  # a graceful stop's, after resume
        ("separate_async", False, False, ["saved"]),  # bitwise: drained, nothing generating
    ],
)
def test_a_save_pauses_the_rollout_that_is_generating_around_verls_snapshot_of_its_queue(
    tmp_path, monkeypatch, mode, lossless, paused_by_verl, pauses
):
    from relay.trainers.verl_ppo import async_trainer

    said: list[str] = []

    class Manager:
        def __init__(self, name):
            self.name = name

        def abort_replicas(self):
            said.append(f"{self.name}.abort")

        def resume_generation_replicas(self):
            said.append(f"{self.name}.resume")

    t, _ = trainer_at(tmp_path, monkeypatch, finished("u0"), lossless=lossless)
    t.checkpoint_manager = Manager("hybrid")
    if mode == "separate_async":
        t.standalone_checkpoint_manager = Manager("standalone")
    t._relay_rollout_paused = paused_by_verl
    monkeypatch.setattr(async_trainer, "_settle", lambda: None)
    with t._relay_queue_paused():
        said.append("saved")
    assert said == pauses
