"""The gate's smoke check of a verl checkpoint: its model shard, in the architecture verl saved beside it,
answers a fixed prompt with finite logits.

verl writes `actor/huggingface/` (config, tokenizer) with every checkpoint and the weights as FSDP shards
(`actor/model_world_size_W_rank_R.pt`). The check reads the shard safely (relay.checkpoints.safeload,
never verl's unpickling load), builds the model from that config with random weights, loads the shard
strictly (every key, every shape) and runs one forward pass on the CPU. It runs at world size 1, where the
shard holds the whole model (the CPU path), on models whose shard is under MAX_BYTES: the gate runs where
Airflow's workers do, which are no place to load a 7B model. Anything else raises Skipped: the
level is recorded as skipped, never as passed.
"""

from __future__ import annotations

from pathlib import Path

from relay.checkpoints import safeload
from relay.checkpoints.validate import Skipped
from relay.runs import layout

PROMPT = "3+4="
MAX_BYTES = 2 << 30


def smoke(spec, step_dir: Path) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    actor = Path(step_dir) / "actor"
    world_size = len(list(actor.glob("model_world_size_*_rank_*.pt")))
    if world_size != 1:
        raise Skipped(f"world size {world_size} (the smoke check loads a whole model from one shard)")
    shard = actor / layout.shard_name("model", 1, 0)
    if shard.stat().st_size > MAX_BYTES:
        raise Skipped(
            f"the model shard is {shard.stat().st_size / 2**30:.1f} GiB (the smoke check loads models under 2 GiB)"
        )
    hf = actor / "huggingface"
    config = AutoConfig.from_pretrained(hf)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=spec.settings.attention or "sdpa", dtype=torch.float32
    )
    state = safeload.load(shard, mmap=True)
    state = {k: (v.to_local() if hasattr(v, "to_local") else v).float() for k, v in state.items()}
    if getattr(config, "tie_word_embeddings", False):
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    model.load_state_dict(state, strict=True)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"the logits of the fixed prompt {PROMPT!r} are not finite")
    top = tokenizer.decode([int(logits[0, -1].argmax())])
    return f"forward pass on {PROMPT!r} ({config.architectures[0]} from huggingface/): finite logits, argmax {top!r}"
