"""The certificate of verl's actor (relay.checkpoints.certificate), computed inside verl's own workers at any
world size.

`worker_piece` runs in every actor worker at once (Ray's `__ray_call__` on the worker group's actors: the
function runs in the actor, beside verl's worker object): each rank hashes its own FSDP2 shards by their global
indices, the sums are all-reduced over the workers' process group (so no rank gathers a tensor), and every rank
runs the probe over the whole probe batch (never split by data-parallel rank or micro-batch: FSDP's forward
needs every rank anyway), inside the engine's eval mode (which loads offloaded parameters). Nothing draws from a
random generator. `certificate_of` assembles rank 0's answer with what the trainer holds (the dataloader).

The probe: a few rows of the training data chosen by the run's seed, each its prompt through the tokenizer's
chat template and its ground truth's tokens.
"""

from __future__ import annotations

import random
import time
from typing import Any

PROBE_SEQUENCES = 4


def probe_ids(dataset: Any, tokenizer: Any, seed: int) -> list[list[int]]:
    """The run's probe: PROBE_SEQUENCES rows of verl's dataset chosen by the seed alone (a generator of its own)."""
    picked = random.Random(f"relay-probe-{seed}").sample(range(len(dataset)), min(PROBE_SEQUENCES, len(dataset)))
    out = []
    for i in sorted(picked):
        row = dataset[i]
        prompt = tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=True)
        if hasattr(prompt, "keys"):  # a BatchEncoding in newer transformers
            prompt = prompt["input_ids"]
        truth = str((row.get("reward_model") or {}).get("ground_truth", ""))
        out.append([int(t) for t in prompt] + tokenizer.encode(truth, add_special_tokens=False))
    return out


def worker_piece(worker: Any, ids: list[list[int]], pad_id: int, digests: bool = True) -> dict[str, Any]:
    """In one actor worker (its Ray actor): this rank's part of the certificate, the parameter digests all-reduced
    (`digests=False`: the probe and the small states only; a save off the critical path digests its copies later,
    relay.trainers.verl_ppo.worker_saves)."""
    import torch
    import torch.distributed as dist
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager
    from verl.utils.device import get_device_name

    from relay.checkpoints import certificate

    engine = actor_of(worker).actor.engine
    module = engine.module
    with engine.eval_mode():
        params, moments, steps = _engine_digests(engine) if digests else ({}, {}, [])
        logprobs, probe_dtype = certificate.probe(module, ids, pad_id)
    state: dict = next(iter(engine.optimizer.state.values()), {})
    scheduler = getattr(engine, "lr_scheduler", None)
    return {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "device": get_device_name(),
        "params": params,
        "optimizer": moments,
        "optimizer_steps": steps,
        "logprobs": logprobs,
        "optimizer_step": int(state["step"]) if "step" in state else None,
        "lr": float(scheduler.get_last_lr()[0]) if scheduler is not None else float(engine.optimizer.param_groups[0]["lr"]),
        "rng": certificate.state_digest(BaseCheckpointManager.get_rng_state()),
        "torch": torch.__version__,
        "portable": certificate.portable(module),
        "probe_dtype": probe_dtype,
    }


def critic_piece(worker: Any) -> dict[str, Any]:
    """In one critic worker (its Ray actor): the critic's parameter and optimizer moment digests, all-reduced over the
    critic's ranks."""
    params, moments, _ = _engine_digests(critic_of(worker).engine)
    return {"params": params, "optimizer": moments}


def _engine_digests(engine: Any) -> tuple[dict[str, str], dict[str, str], list[int]]:
    """An engine's parameter and optimizer moment digests, this rank's pieces all-reduced over the ranks in one
    collective (FSDP1's flat parameters by their original parameters too), and the parameters' optimizer steps."""
    import torch
    import torch.distributed as dist
    from verl.utils.device import get_device_name

    from relay.checkpoints import certificate

    named = certificate.named_pieces(engine.module)
    moments, steps = certificate.optimizer_pieces(engine.module, engine.optimizer)
    sums = certificate.piece_sums([piece for _, piece in named + moments])
    device = "cpu" if get_device_name() == "cpu" else torch.device(get_device_name(), torch.cuda.current_device())
    total = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in sums], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(total)  # int64 wraps: the sum modulo 2^64, as at world size 1
    values = [f"{int(v) & ((1 << 64) - 1):016x}" for v in total.tolist()]
    return (
        {n: v for (n, _), v in zip(named, values[: len(named)], strict=True)},
        {n: v for (n, _), v in zip(moments, values[len(named) :], strict=True)},
        steps,
    )


def _candidates(worker: Any) -> list[Any]:
    """verl's worker objects inside one Ray actor (colocated roles are a dict of them)."""
    return [
        worker,
        *getattr(worker, "worker_dict", {}).values(),
        *getattr(worker, "fused_worker_dict", {}).values(),
    ]


def critic_of(worker: Any) -> Any:
    """verl's critic worker object (a TrainingWorker of the value model) inside its Ray actor."""
    for candidate in _candidates(worker):
        if getattr(candidate, "engine", None) is not None and getattr(candidate, "actor", None) is None:
            return candidate
    raise RuntimeError(f"no critic engine in {type(worker).__name__}: verl's worker layout changed")


def actor_of(worker: Any) -> Any:
    """verl's worker object that holds the actor engine, inside the Ray actor (colocated workers are a dict)."""
    for candidate in _candidates(worker):
        if getattr(getattr(candidate, "actor", None), "engine", None) is not None:
            return candidate
    raise RuntimeError(f"no actor engine in {type(worker).__name__}: verl's worker layout changed")


def certificate_of(trainer: Any, step: int, ids: list[list[int]], pad_id: int, digests: bool = True) -> Any:
    """The certificate of the state verl's actor holds now (every worker at once), and the trainer's data position;
    `digests=False`: without the parameters' and optimizer's digests (given later, from the save's copies)."""
    import ray

    from relay.checkpoints import certificate

    t0 = time.perf_counter()
    workers = trainer.actor_rollout_wg.workers
    pieces = ray.get([w.__ray_call__.remote(worker_piece, ids, pad_id, digests) for w in workers])
    first = min(pieces, key=lambda p: p["rank"])
    critic: dict[str, dict[str, str]] = {"params": {}, "optimizer": {}}
    if getattr(trainer, "use_critic", False):  # the value model's state, digested live (also off the critical path)
        critic = ray.get([w.__ray_call__.remote(critic_piece) for w in trainer.critic_wg.workers])[0]
    return certificate.Certificate(
        step=step,
        world_size=first["world_size"],
        device=first["device"],
        probe_ids=ids,
        logprobs=first["logprobs"],
        params=first["params"],
        optimizer_step=first["optimizer_step"],
        lr=first["lr"],
        data=certificate.state_digest(trainer.train_dataloader.state_dict()),
        rng=first["rng"],
        probe_seconds=round(time.perf_counter() - t0, 4),
        torch=first["torch"],
        pad_id=pad_id,
        portable=first["portable"],
        optimizer=first["optimizer"],
        optimizer_steps=first["optimizer_steps"],
        probe_dtype=first["probe_dtype"],
        critic=critic["params"],
        critic_optimizer=critic["optimizer"],
    )
