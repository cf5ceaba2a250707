"""Sampling a response with transformers and a generator of its own: the hf rollout's (hf_rollout.py), and
the GPU check's, which runs where Ray and verl's rollout classes are not installed (bench/gpu/check.py).
Imports torch only."""

from __future__ import annotations

import hashlib

import torch


def seed_of(base: int, step: int, sample_id: str) -> int:
    """A seed from the rollout's seed, the step and the sample's identity: the same response wherever it is made."""
    digest = hashlib.sha256(f"{base}:{step}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


@torch.no_grad()
def sample(
    model,
    prompt_ids: list[int],
    max_new: int,
    eos_ids: set[int],
    seed: int,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
) -> tuple[list[int], list[float]]:
    """Autoregressive sampling with a KV cache. temperature 0 is greedy (verl's validation)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[:, -1, :].float()
    tokens: list[int] = []
    logps: list[float] = []
    for _ in range(max_new):
        if temperature <= 0:
            tok = int(torch.argmax(logits, dim=-1))
            logp = float(torch.log_softmax(logits, dim=-1)[0, tok])
        else:
            scaled = _filter(logits / temperature, top_k, top_p)
            probs = torch.softmax(scaled, dim=-1)
            tok = int(torch.multinomial(probs, 1, generator=gen)[0, 0])
            logp = float(torch.log(probs[0, tok]))
        tokens.append(tok)
        logps.append(logp)
        if tok in eos_ids:
            break
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1, :].float()
    return tokens, logps


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits
