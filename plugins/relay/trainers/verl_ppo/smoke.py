"""The gate's smoke check of a verl checkpoint: its model shard, in the architecture verl saved beside it,
answers a fixed prompt with finite logits.

verl writes `actor/huggingface/` (config, tokenizer) with every checkpoint and the weights as FSDP shards
(`actor/model_world_size_W_rank_R.pt`). The check reads every rank's shard safely (relay.checkpoints.shards
over safeload, never verl's unpickling load), puts each tensor's pieces together (FSDP1 or FSDP2, any world size),
builds the model from that config with random weights, loads the weights strictly (every key, every shape) and
runs one forward pass on the CPU, on models whose shards are under MAX_BYTES: the gate runs where Airflow's
workers do (or in a Ray job, `validate_on: ray`), which are no place to load a 7B model. A larger model raises
Skipped: the level is recorded as skipped, never as passed. The certificate check compares each parameter's
digest from the shards' pieces (nothing gathered for it) and the probe of the whole model.
"""

from __future__ import annotations

from pathlib import Path

from relay.checkpoints import shards
from relay.checkpoints.validate import Skipped

PROMPT = "3+4="
MAX_BYTES = 2 << 30


def _checkpoint_model(spec, step_dir: Path):
    """(the model in float32 with the checkpoint's weights, its shards as stored, its config, the huggingface/
    folder), or Skipped where one host's worker cannot load it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    actor = Path(step_dir) / "actor"
    stored = shards.read(step_dir)
    if stored.nbytes > MAX_BYTES:
        raise Skipped(
            f"the model shards are {stored.nbytes / 2**30:.1f} GiB (the gate loads models under 2 GiB; the "
            "certificate is checked at resume, in the trainer's workers)"
        )
    hf = actor / "huggingface"
    config = AutoConfig.from_pretrained(hf)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=spec.settings.attention or "sdpa", dtype=torch.float32
    )
    state = stored.full(torch.float32)  # every rank's pieces put together, at any world size and FSDP version
    if getattr(config, "tie_word_embeddings", False):
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    model.load_state_dict(state, strict=True)
    return model.eval(), stored, config, hf


def smoke(spec, step_dir: Path) -> str:
    import torch
    from transformers import AutoTokenizer

    model, _, config, hf = _checkpoint_model(spec, step_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"the logits of the fixed prompt {PROMPT!r} are not finite")
    top = tokenizer.decode([int(logits[0, -1].argmax())])
    return f"forward pass on {PROMPT!r} ({config.architectures[0]} from huggingface/): finite logits, argmax {top!r}"


def certify(spec, step_dir: Path, saved) -> str:
    """The checkpoint against the certificate verl's workers wrote: every parameter of the shard, as stored, has
    its certified digest, and the model loaded offline gives the probe's log-probs within
    checkpoints.offline_tolerance (another forward path than the workers')."""
    import torch

    from relay.checkpoints import certificate
    from relay.common.errors import CertificateError

    if not saved.portable:
        raise Skipped("the certificate holds FSDP1's flat parameters: the trainer checks it at resume")
    model, stored, _, _ = _checkpoint_model(spec, step_dir)
    ours = stored.digests(saved.params)  # from the pieces at their global offsets, at the checkpoint's world size
    problems = []
    if differ := sorted(n for n in saved.params if ours.get(n) != saved.params[n]):
        problems.append(f"{len(differ)} of {len(saved.params)} parameters are not those certified: {', '.join(differ[:5])}")
    # in the dtype the workers' forward ran in (FSDP's mixed precision computes in bfloat16), from these weights
    logprobs = certificate.probe_logprobs(model.to(getattr(torch, saved.probe_dtype)), saved.probe_ids, saved.pad_id)
    diffs = [abs(a - b) for xs, ys in zip(saved.logprobs, logprobs, strict=True) for a, b in zip(xs, ys, strict=True)]
    largest = max(diffs, default=0.0)
    tolerance = spec.checkpoints.offline_tolerance
    if not largest <= tolerance:
        problems.append(f"the probe's log-probs differ from the certificate's by up to {largest:.3g} (> {tolerance:g})")
    if problems:
        raise CertificateError(f"{Path(step_dir).name} does not reproduce its certificate: " + "; ".join(problems))
    return (
        f"the model loaded offline reproduces its certificate: {len(ours)} parameter digests equal at world size "
        f"{stored.world_size}, probe log-probs within {largest:.3g}"
    )
