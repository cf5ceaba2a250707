"""`relay model tiny DIR`: a verl-ready model made here (issue 15's tiny model), as verl's trainer reads it."""

from __future__ import annotations

import hashlib

import pytest

from relay.common.errors import RelayError
from relay.trainers.verl_ppo.cpu.tiny_model import ensure_tiny_model, make_tiny_model
from support.helpers import relay_cli


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_the_command_makes_the_same_model_on_every_machine_and_never_overwrites(tmp_path):
    r = relay_cli("model", "tiny", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert str(tmp_path / "a") in r.stdout
    make_tiny_model(tmp_path / "b")
    assert digests(tmp_path / "a") == digests(tmp_path / "b"), "drawn from a fixed seed: the same bytes"
    again = relay_cli("model", "tiny", str(tmp_path / "a"))
    assert again.returncode == 1 and "is not empty" in again.stderr and "give a new folder" in again.stderr
    assert digests(tmp_path / "a") == digests(tmp_path / "b"), "the folder is untouched"
    assert not ensure_tiny_model(tmp_path / "a"), "there already: not made again"


def test_verl_reads_it_a_chat_prompt_round_trips_and_the_model_generates(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    from verl.utils import hf_tokenizer

    folder = tmp_path / "m"
    assert ensure_tiny_model(folder)
    tok = hf_tokenizer(str(folder))  # how verl's trainer loads the tokenizer (main_ppo's TaskRunner)
    messages = [{"role": "user", "content": "What is 12 + 30? Answer: ünï ✓"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 12 + 30? Answer: ünï ✓<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text, "byte-level: any text encodes and decodes exactly"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.architectures == ["Qwen2ForCausalLM"] and model.config.vocab_size == len(tok)
    torch.manual_seed(0)
    out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=True, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > len(ids)
    logits = model(torch.tensor([ids])).logits
    assert torch.isfinite(logits).all()


def test_a_missing_parent_and_concurrent_callers_get_one_model(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    folder = tmp_path / "deep" / "models" / "tiny"
    with ThreadPoolExecutor(3) as pool:
        made = list(pool.map(lambda _: ensure_tiny_model(folder), range(3)))
    assert sorted(made) == [False, False, True]
    assert (folder / "config.json").is_file() and not list(folder.parent.glob(".tiny.tmp*"))


def test_a_folder_with_other_files_is_refused(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(RelayError, match="is not empty"):
        make_tiny_model(tmp_path / "x")
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"
