"""The hf rollout's adapter on its own (no Ray): what verl's naive checkpoint engine feeds it and what it
answers. Its end-to-end use, inside verl's loop, is tests/trainers/test_verl_cpu_fit.py."""

from __future__ import annotations

import asyncio

import pytest

from relay.trainers.verl_ppo.cpu.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from omegaconf import OmegaConf
    from verl.workers.config import RolloutConfig

    from relay.trainers.verl_ppo.cpu.hf_rollout import HFServerAdapter

    path = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    model = OmegaConf.create(
        {
            "_target_": "verl.workers.config.HFModelConfig",
            "path": str(path),
            "use_remove_padding": False,
            "override_config": {"attn_implementation": "sdpa"},
        }
    )
    return HFServerAdapter(RolloutConfig(name="hf", response_length=6, prompt_length=8, seed=3), model, None)


def test_a_response_depends_on_the_sample_and_the_step_never_on_the_order_of_requests(adapter):
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    first = [adapter.generate([5, 6, 7], params, f"{i}/0").token_ids for i in range(4)]
    again = [adapter.generate([5, 6, 7], params, f"{i}/0").token_ids for i in reversed(range(4))][::-1]
    assert first == again and len({tuple(t) for t in first}) > 1
    assert all(len(t) <= 6 for t in first)  # response_length
    greedy = {tuple(adapter.generate([5, 6, 7], {"temperature": 0}, f"{i}/0").token_ids) for i in range(3)}
    assert len(greedy) == 1  # validation's greedy decoding ignores the seed


def test_the_actors_weights_replace_the_rollouts_and_a_wrong_set_is_refused(adapter):
    import torch

    state = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    before = adapter.generate([5, 6, 7], {"temperature": 0}, "0/0").token_ids
    moved = {k: v + 0.5 if v.is_floating_point() else v for k, v in state.items()}
    asyncio.run(adapter.update_weights(iter(moved.items()), global_steps=7))
    assert adapter.global_steps == 7
    assert all(torch.equal(adapter.model.state_dict()[k], moved[k]) for k in moved)
    assert adapter.generate([5, 6, 7], {"temperature": 0}, "0/0").token_ids != before
    with pytest.raises(KeyError, match="does not have"):
        asyncio.run(adapter.update_weights(iter([("no.such.weight", torch.zeros(1))])))
    partial = list(state.items())[1:]
    with pytest.raises(KeyError, match="stale"):
        asyncio.run(adapter.update_weights(iter(partial)))
    asyncio.run(adapter.update_weights(iter(state.items()), global_steps=0))
