"""verl under contract (relay.trainers.verl_ppo.verl_contract): every touch point of verl (and torch, and Ray) that
Relay relies on without a public promise holds in the pinned verl; each one, hidden, is named with the installed
version, and a job refuses to train; a changed shape (a signature, a registry's keys, a tag) is named too.
`relay doctor` runs the same checks on the cluster: tests/insights/test_doctor.py."""

from __future__ import annotations

import pytest

from relay.trainers.verl_ppo import horizon, verl_contract
from relay.trainers.verl_ppo.verl_contract import TOUCH_POINTS, VerlContractError, check

SYMBOLS = [p.symbol for p in TOUCH_POINTS]


def hide(monkeypatch, symbol: str) -> None:
    """The symbol gone, as a verl release that renamed or removed it would have it (undone after the test)."""
    owner, name = verl_contract.owner_of(symbol)
    if isinstance(owner, type):  # a method verl's class inherits: gone from the class that defines it
        owner = next(c for c in owner.__mro__ if name in vars(c))
    monkeypatch.delattr(owner, name)


def test_the_contract_lists_each_symbol_once_with_why_and_since():
    assert len(set(SYMBOLS)) == len(SYMBOLS) > 40
    for p in TOUCH_POINTS:
        assert p.why and p.since and p.package in ("verl", "torch"), p


@pytest.mark.parametrize("symbol", SYMBOLS)
def test_every_touch_point_holds_in_the_pinned_verl(symbol):
    [point] = [p for p in TOUCH_POINTS if p.symbol == symbol]
    assert check(point) is None


@pytest.mark.parametrize("symbol", SYMBOLS)
def test_a_hidden_touch_point_is_named_with_the_installed_version(monkeypatch, symbol):
    [point] = [p for p in TOUCH_POINTS if p.symbol == symbol]
    hide(monkeypatch, symbol)
    why = check(point)
    assert why is not None, f"{symbol} hidden, and its check did not notice"
    from importlib.metadata import version

    assert why.startswith(f"{symbol} ") and f"in {point.package} {version(point.package)}" in why
    assert f"since {point.package} {point.since}" in why and point.why in why


def test_a_changed_signature_registry_or_tag_is_named(monkeypatch):
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    def select(self, partition, keys, n):  # renamed parameters: Relay's override would be called wrongly
        return [], {}, {}

    monkeypatch.setattr(ReplayBufferAsync, "_select_prompt_uids", select)
    [why] = verl_contract.problems(names=["_select_prompt_uids"])
    assert "takes (partition, keys, n), Relay relies on (partition_id, sampleable_keys, batch_size)" in why

    monkeypatch.setitem(trainer_base.__dict__, "TRAINER_REGISTRY", {"sync": object()})
    [why] = verl_contract.problems(names=["TRAINER_REGISTRY"])
    assert "no longer holds 'colocate_async', 'separate_async'" in why

    def submit(self, batch):  # a verl that tags the prompts it hands out otherwise: Relay's drain would wait for none
        tags = [{"prompt": True, "state": "queued"} for _ in range(len(batch))]
        return len(tags)

    monkeypatch.setattr(PPOTrainer, "_submit_batch_to_rollout", submit)
    [why] = verl_contract.problems(names=["_submit_batch_to_rollout"])
    assert '`"is_prompt": True, "status": "pending"`' in why and "the drain" in why


def test_a_job_refuses_to_train_on_a_verl_without_a_touch_point(monkeypatch):
    assert verl_contract.require(cpu=True) == len(verl_contract.required(cpu=True))
    hide(monkeypatch, "verl.trainer.ppo.v1.replay_buffer:ReplayBufferAsync._select_prompt_uids")
    with pytest.raises(VerlContractError) as e:
        verl_contract.require(cpu=False)
    assert "ReplayBufferAsync._select_prompt_uids is gone" in e.value.what and "verl 0.9.1" in e.value.what
    assert "relay doctor" in e.value.fix


def test_a_cpu_only_touch_point_matters_on_the_cpu_platform_only(monkeypatch):
    hide(monkeypatch, "verl.workers.rollout.base:_ROLLOUT_REGISTRY")
    assert verl_contract.require(cpu=False) > 30
    with pytest.raises(VerlContractError, match="_ROLLOUT_REGISTRY is gone"):
        verl_contract.require(cpu=True)


def test_a_missing_loop_bound_fact_falls_back_to_the_horizon_rule_not_a_refusal(monkeypatch):
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    monkeypatch.setattr(PPOTrainer, "fit", lambda self, agent_loop_manager: None)  # verl's loop, rewritten
    horizon._loop_bound_problems.cache_clear()
    try:
        [why] = horizon.loop_bound_problems()
        assert "PPOTrainer.fit no longer has `self.global_steps <= self.total_training_steps`" in why
        assert verl_contract.require(cpu=True)  # the job still trains, its chunks ending through total_training_steps
    finally:
        horizon._loop_bound_problems.cache_clear()


def test_the_module_reports_as_doctor_reads_it(capsys):
    assert verl_contract.main(["--json", "--cpu"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(verl_contract.MARK)
    import json

    found = json.loads(line[len(verl_contract.MARK) :])
    assert found["verl"] == "0.9.1" and found["problems"] == [] and found["checked"] == len(TOUCH_POINTS)
