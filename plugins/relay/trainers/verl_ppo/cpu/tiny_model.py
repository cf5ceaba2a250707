"""A tiny verl-ready model made here, with no download: a few-layer Qwen2 decoder and a byte-level tokenizer.

What verl's trainer needs from a model folder (`actor_rollout_ref.model.path`): a transformers config
that names its architecture, weights, and a tokenizer with a chat template (verl's RL dataset applies it
to every prompt) and eos and pad tokens. The tokenizer is byte-level BPE without merges: every UTF-8 byte
is one token, so any text encodes and nothing has to be learned or fetched. The weights are drawn from a
fixed seed, so the same command makes the same bytes on every machine (a run's first step is then
reproducible from its spec alone).

`relay model tiny DIR` writes one; a spec whose model path is missing gets one there before its first
chunk (ensure_tiny_model), so trying verl's trainer on a laptop needs no extra step.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from relay.common import files
from relay.common.errors import RelayError
from relay.common.filelock import file_lock

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"
# Qwen2's ChatML template, as Qwen's own tokenizers carry it (verl's RL dataset calls apply_chat_template
# with add_generation_prompt=True on each prompt's list of {role, content}).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
MARKER = "relay_tiny_model.json"  # what made the folder: a folder without it is never overwritten


@dataclass(frozen=True)
class TinyModelShape:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    max_positions: int = 1024
    seed: int = 0


TINY = TinyModelShape()  # the default shape (frozen: one instance serves every call)


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (256 byte tokens, then the ChatML specials)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of GPT-2's byte-level BPE
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=TinyModelShape.max_positions,
        padding_side="left",
    )


def make_tiny_model(folder: Path, shape: TinyModelShape = TINY) -> Path:
    """Write the tiny model into `folder` (created; written in a staging folder, then renamed into place)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise RelayError(
            f"{folder} is not empty: a tiny model is only written into a new folder",
            "give a new folder, or remove this one if it holds nothing you need",
            retry_helps=False,
        )
    tokenizer = byte_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
        torch.manual_seed(shape.seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    staging = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / MARKER).write_text(json.dumps({"made_by": "relay model tiny", **asdict(shape)}, indent=2) + "\n")
    if folder.exists():
        folder.rmdir()  # empty (checked above)
    os.replace(staging, folder)
    files.fsync_dir(folder.parent)
    return folder


def ensure_tiny_model(folder: Path, shape: TinyModelShape = TINY) -> bool:
    """Make the tiny model at `folder` unless it is there already; True when it was made now. Several
    chunks (or hosts on shared storage) may ask at once: one makes it, the others find it made."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(folder.parent / f".{folder.name}.lock", "making the tiny model", timeout=600):
        if (folder / "config.json").is_file():
            return False
        make_tiny_model(folder, shape)
        return True
