"""The async chunk trainer's checks of the prompts in flight (relay.trainers.verl_ppo.async_trainer), on the ledger a
save wrote and TransferQueue's listing after verl's load (stood in: the queue itself needs verl's Ray actors; verl's
lane runs the real one, tests/airflow/test_verl_async_dag.py), and its first-in-first-out choice."""

from __future__ import annotations

import types

import pytest

from relay.runs import layout
from relay.runs.prompt_ledger import PromptLedger


class Refused(Exception):
    pass


def trainer_at(tmp_path, monkeypatch, queue: dict):
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
    buffer.prompt_order = ledger.order
    chosen, _, _ = buffer._select_prompt_uids("train", {"mid", "early", "late"}, 2)
    assert chosen == ["late", "early"]
    from relay.common.errors import RelayError

    with pytest.raises(RelayError, match="never handed out"):
        buffer._select_prompt_uids("train", {"mid", "stranger"}, 1)
