"""The tiny model's task for verl's own trainer on a CPU (relay/trainers/verl_ppo/cpu/tiny_task.py) and its
spec (include/runs/verl_tiny_cpu.yaml): the data is deterministic, in verl's RL schema and read by verl's
own dataset code with the tiny tokenizer; the reward gives partial credit, so a random model's answers to
one prompt score unevenly (GRPO has something to learn from); verl's own reward manager calls it as the
spec configures it; and the spec composes into verl's config with one of each helper process, passing
verl's validate_config. No services."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from relay.common.errors import RelayError
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from relay.trainers.verl_ppo.cpu import tiny_task
from relay.trainers.verl_ppo.cpu.tiny_model import byte_tokenizer, make_tiny_model
from support.helpers import ROOT

SPEC = ROOT / "include" / "runs" / "verl_tiny_cpu.yaml"
SHIPPED = ROOT / "include" / "data" / "tiny_arith"
# The model's attention on a CPU. verl's model.override_config is an empty mapping, so only a '+' key sets
# it, which a spec's overrides may not write: Relay's overrides.py is to add this line for the spec. Until
# it does, the tests add it themselves, to check that the rest composes and validates with it.
SDPA = "+actor_rollout_ref.model.override_config.attn_implementation='sdpa'"


def rows(path) -> list[dict]:
    return pq.read_table(path).to_pylist()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def spec_config(*extra: str, check_environment: bool = False):
    """verl's config for the spec's first chunk, composed as the trainer composes it (overrides.compose)."""
    from relay.trainers.verl_ppo import overrides

    spec = load_spec(SPEC, check_environment=check_environment)
    lines = overrides.chunk_overrides(
        Run.of(spec, "verl_tiny_cpu"),
        first_step_of_run=True,
        data={"train": spec.data.train_files, "val": spec.data.val_files},
    )
    if not any("override_config.attn_implementation" in line for line in lines):
        lines.append(SDPA)
    return spec, overrides.compose(lines + list(extra))


# ------------------------------------------------------------------------------------------- data


def test_the_dataset_is_deterministic_in_verls_schema_and_holds_validation_out(tmp_path):
    a = tiny_task.make_dataset(tmp_path / "a", train_rows=64, val_rows=8, seed=3)
    b = tiny_task.make_dataset(tmp_path / "b", train_rows=64, val_rows=8, seed=3)
    c = tiny_task.make_dataset(tmp_path / "c", train_rows=64, val_rows=8, seed=4)
    assert a == {"train": [str(tmp_path / "a" / "train.parquet")], "val": [str(tmp_path / "a" / "val.parquet")]}
    for split in ("train", "val"):
        assert rows(a[split][0]) == rows(b[split][0]), "the same seed writes the same rows"
        assert Path(a[split][0]).read_bytes() == Path(b[split][0]).read_bytes()
    assert rows(a["train"][0]) != rows(c["train"][0]), "another seed, other problems"

    train, val = rows(a["train"][0]), rows(a["val"][0])
    assert (len(train), len(val)) == (64, 8)
    for split, table in (("train", train), ("val", val)):
        for i, r in enumerate(table):
            assert set(r) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
            assert r["data_source"] == tiny_task.DATA_SOURCE == "relay_tiny_arith" and r["ability"] == "math"
            [message] = r["prompt"]
            assert message["role"] == "user" and message["content"].endswith("=")
            x, y = map(int, message["content"][:-1].split("+"))
            assert r["reward_model"] == {"style": "rule", "ground_truth": str(x + y)}
            assert r["extra_info"] == {"split": split, "index": i, "question": message["content"], "answer": str(x + y)}
    held_out = {r["prompt"][0]["content"] for r in val}
    assert not held_out & {r["prompt"][0]["content"] for r in train}, "validation problems never appear in train"
    assert not list(tmp_path.glob("*/.*.tmp*")), "nothing half-written is left behind"


def test_the_shipped_data_is_what_make_dataset_writes(tmp_path):
    """include/data/tiny_arith/ (the spec's data) is the default call's output, row for row (the bytes
    also carry the pyarrow version that wrote them)."""
    made = tiny_task.make_dataset(tmp_path)
    for split in ("train", "val"):
        assert rows(SHIPPED / f"{split}.parquet") == rows(made[split][0]), (
            f"include/data/tiny_arith/{split}.parquet is stale: rewrite it with "
            "tiny_task.make_dataset('include/data/tiny_arith')"
        )
    spec = load_spec(SPEC, check_environment=False)
    assert spec.data.train_files == [str(SHIPPED / "train.parquet")]
    assert spec.data.val_files == [str(SHIPPED / "val.parquet")]


def test_bad_row_counts_are_refused_with_what_to_do(tmp_path):
    with pytest.raises(RelayError, match="must be >= 1"):
        tiny_task.make_dataset(tmp_path, val_rows=0)
    with pytest.raises(RelayError, match="ask for fewer rows"):
        tiny_task.make_dataset(tmp_path, train_rows=10_000, val_rows=1)


def test_every_prompt_fits_max_prompt_length_after_the_chat_template():
    """One token a byte: the chat template's framing plus "ab+cd=" is about 25 tokens, far below 64."""
    tok = byte_tokenizer()
    limit = load_spec(SPEC, check_environment=False).settings.max_prompt_length
    lengths = [
        len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False))
        for split in ("train", "val")
        for r in rows(SHIPPED / f"{split}.parquet")
    ]
    assert max(lengths) <= 26 < limit // 2, max(lengths)


def test_verls_own_dataset_reads_it_with_the_tiny_tokenizer_and_keeps_every_row(tiny_model, tmp_path, monkeypatch):
    """As verl's trainer builds its datasets (v1 trainer_base._init_dataloader -> create_rl_dataset), with
    verl's own model config (the tokenizer it loads from the model folder), filtering overlong prompts."""
    import datasets
    from omegaconf import open_dict
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.config import omega_conf_to_dataclass

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))  # not ~/.cache
    _, cfg = spec_config(f"actor_rollout_ref.model.path={tiny_model}")
    model = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)  # verl's HFModelConfig
    assert model.hf_config._attn_implementation == "sdpa"  # not flash_attention_2, absent on a CPU
    data = cfg.data
    with open_dict(data):
        data.filter_overlong_prompts = True  # drops (here: would drop) what exceeds max_prompt_length
        data.cache_dir = str(tmp_path / "verl-cache")
    for files, n in ((data.train_files, 256), (data.val_files, 16)):
        ds = create_rl_dataset(files, data, model.tokenizer, model.processor, is_train=True)
        assert len(ds) == n, "no prompt is over max_prompt_length"
        item = ds[0]
        assert item["raw_prompt"] == rows(files[0])[0]["prompt"] and item["data_source"] == tiny_task.DATA_SOURCE
        assert item["reward_model"]["ground_truth"] == rows(files[0])[0]["reward_model"]["ground_truth"]


# ----------------------------------------------------------------------------------------- reward


def score(response: str, truth: str = "83") -> float:
    return tiny_task.compute_score(tiny_task.DATA_SOURCE, response, truth, extra_info={"index": 0})


def test_the_reward_gives_partial_credit_up_to_the_exact_answer():
    assert score("83") == 1.0 and score(" 83\n") == 1.0
    assert score("") == score("no digits") == 0.0
    ladder = [score("x%&@!5"), score("x8"), score("51"), score("86"), score("83 and more")]
    assert ladder == sorted(ladder) and len(set(ladder)) == len(ladder), ladder  # each step is worth more
    assert 0 < ladder[0] and ladder[-1] < 1.0
    assert score("100", "100") == 1.0 and score("109", "100") > score("19", "100") > score("9", "100") > 0
    assert score("٣٨") == 0.0, "only ASCII digits count"


def test_the_reward_spreads_random_responses():
    """Random byte strings, as a random byte-level model writes them: scores differ, all in [0, 0.9]."""
    rng = random.Random(0)
    responses = [bytes(rng.randrange(256) for _ in range(16)).decode("utf-8", "replace") for _ in range(32)]
    scores = [score(r) for r in responses]
    assert all(0.0 <= s <= 0.9 for s in scores)
    assert len(set(scores)) >= 8 and sum(s > 0 for s in scores) >= 8, scores


def test_a_random_tiny_model_scores_unevenly_within_a_group(tiny_model):
    """The point of partial credit: GRPO's advantage is a score minus its group's mean, so responses to one
    prompt must differ. 4 prompts x 4 sampled responses of 16 tokens, as the spec samples them."""
    import torch
    from transformers import AutoModelForCausalLM
    from verl.utils import hf_tokenizer

    spec = load_spec(SPEC, check_environment=False)
    s = spec.settings
    tok = hf_tokenizer(str(tiny_model))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="sdpa")
    uneven = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        for r in rows(SHIPPED / "train.parquet")[:4]:
            ids = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True)[
                "input_ids"
            ]
            out = model.generate(
                ids.repeat(s.rollout_n, 1),
                do_sample=True,
                temperature=s.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=s.max_response_length,
                pad_token_id=tok.pad_token_id,
            )
            answers = tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
            group = {score(a, r["reward_model"]["ground_truth"]) for a in answers}
            uneven += len(group) > 1
    assert uneven >= 3, "most groups have a spread of scores"


def test_a_foreign_data_source_is_refused_with_what_to_do():
    with pytest.raises(RelayError, match=r"'openai/gsm8k'.*only knows 'relay_tiny_arith'") as e:
        tiny_task.compute_score("openai/gsm8k", "42", "42")
    assert "custom_reward_function" in str(e.value)


def test_verl_loads_the_reward_from_either_path_form():
    """verl's load_extern_object (verl/utils/import_utils.py), as get_custom_reward_fn calls it."""
    from verl.utils.import_utils import load_extern_object

    assert load_extern_object(tiny_task.REWARD_MODULE, "compute_score") is tiny_task.compute_score
    path = tiny_task.reward_function_path()
    assert Path(path).is_absolute() and path == str(Path(tiny_task.__file__).resolve())
    by_file = load_extern_object(path, "compute_score")  # a copy of the module, loaded from the file
    assert by_file(tiny_task.DATA_SOURCE, "83", "83") == 1.0


def test_verls_reward_manager_calls_it_as_the_spec_configures_it():
    """verl's own reward loop path: load_reward_manager reads reward.custom_reward_function from the
    composed config; the naive manager decodes a response and calls compute_score(data_source=...,
    solution_str=..., ground_truth=..., extra_info=...). The score is ours, for the decoded text."""
    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    _, cfg = spec_config()
    tok = byte_tokenizer()
    manager = load_reward_manager(cfg, tok)
    assert type(manager).__name__ == "NaiveRewardManager"
    for response, truth in (("83", "83"), ("86 x", "83"), ("@@", "83")):
        prompt = tok("12+71=", return_tensors="pt")["input_ids"]
        resp = tok(response, return_tensors="pt")["input_ids"]
        data = DataProto.from_dict(
            tensors={
                "prompts": prompt,
                "responses": resp,
                "attention_mask": torch.ones(1, prompt.shape[1] + resp.shape[1], dtype=torch.long),
            },
            non_tensors={
                "data_source": np.array([tiny_task.DATA_SOURCE], dtype=object),
                "reward_model": np.array([{"style": "rule", "ground_truth": truth}], dtype=object),
                "extra_info": np.array([{"index": 0}], dtype=object),
            },
        )
        out = manager.loop.run_until_complete(manager.run_single(data))
        assert out["reward_score"] == score(response, truth)
    assert out["reward_score"] == 0.0 and score("83") == 1.0


# ------------------------------------------------------------------------------------------- spec


def test_the_spec_passes_relays_check_with_its_data(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAY_CHECKPOINT_ROOT", str(tmp_path / "ckpt"))  # the writability probe goes there
    spec = load_spec(SPEC)  # with the environment: data files exist and supply total_steps
    s = spec.settings
    assert (spec.trainer.kind, s.rollout_name, s.adv_estimator, s.fsdp_version) == ("verl_ppo", "hf", "grpo", 2)
    assert (s.rollout_n, spec.chunk_steps, spec.total_steps, s.nnodes, s.n_gpus_per_node) == (4, 2, 6, 1, 1)
    # a warmup and a cosine decay over the run's steps: a chunk that reset or stretched the schedule would show
    assert (s.optim.lr_scheduler_type, s.optim.lr_warmup_steps) == ("cosine", 2) and s.optim.horizon_dependent
    assert s.steps_available(256) >= spec.total_steps
    assert Path(s.model_path).is_absolute()
    assert s.device == "cpu" and s.tiny_model and s.attention == "sdpa"
    # the cpu platform comes with device: cpu, in every job's environment (not the spec's env_vars)
    from relay.trainers.contract import ChunkRequest
    from relay.trainers.verl_ppo.trainer import job_env
    from relay.trainers.verl_ppo.verl_contract import CPU_PLATFORM_ENV

    env = job_env(ChunkRequest(run=Run.of(spec, "r"), to_step=2))
    assert CPU_PLATFORM_ENV.items() <= env.items() and spec.ray.env_vars == {}


def test_the_spec_composes_into_verls_config_for_a_cpu_and_passes_verls_validation():
    from relay.trainers.verl_ppo import overrides

    _spec, cfg = spec_config()
    a = cfg.actor_rollout_ref
    # one of each of verl's helper processes; the dataloader in the trainer itself
    assert a.rollout.agent.num_workers == 1 and cfg.reward.num_workers == 1
    assert cfg.data.dataloader_num_workers == 0
    assert cfg.transfer_queue.backend.SimpleStorage.num_data_storage_units == 1
    # the model and its device
    assert a.model.override_config.attn_implementation == "sdpa" and a.model.use_remove_padding is False
    assert a.actor.fsdp_config.use_torch_compile is False and a.ref.fsdp_config.use_torch_compile is False
    assert cfg.trainer.device == "cpu" and a.rollout.name == "hf" and a.rollout.tensor_model_parallel_size == 1
    # the reward
    assert cfg.reward.custom_reward_function.path == tiny_task.REWARD_MODULE
    assert cfg.reward.custom_reward_function.name == tiny_task.REWARD_FUNCTION == "compute_score"
    # the sizes
    assert (cfg.data.train_batch_size, a.rollout.n, a.actor.ppo_mini_batch_size) == (4, 4, 4)
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (64, 16)
    assert cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes == 1 and list(cfg.trainer.logger) == ["console"]
    assert a.actor.optim.lr_scheduler_type == "cosine" and cfg.trainer.total_training_steps == 6
    assert cfg.trainer.save_freq == 2 and cfg.algorithm.adv_estimator == "grpo"
    overrides.check_config(cfg)  # verl.utils.config.validate_config, as main_ppo runs it
