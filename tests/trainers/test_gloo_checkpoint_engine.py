"""Relay's gloo checkpoint engine (relay.trainers.verl_ppo.cpu.gloo_checkpoint_engine), driven as verl's
CheckpointEngineManager drives it, without Ray: two actor ranks (engine ranks 0 and -1, each walking its own
generator of the same weights, as FSDP ranks do) and one rollout worker (rank 1), each an OS process; two syncs in
a row, each with a group built and dropped, the second with other values."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
import traceback
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.processes  # three processes over gloo: not in the fast lane

BUCKET = 4096
STEPS = (1, 2)
ROLES = ("actor0", "actor1", "rollout")
TIMEOUT = 120


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "embed.f32": torch.randn(3, 5, generator=g),
        "norm.bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),  # 42 bytes: the next tensor's offset must align
        "ids.i64": torch.randint(-(2**62), 2**62, (5,), generator=g, dtype=torch.int64),
        "proj.transposed": torch.randn(6, 4, generator=g).t(),  # not contiguous
        "big.f32": torch.randn(2500, generator=g),  # 10,000 bytes: three chunks of a 4096-byte bucket
        "scale.f64": torch.tensor(float(step) / 3, dtype=torch.float64),  # no dimensions
        "empty.f32": torch.empty(0, 4),
        "mask.bool": torch.rand(9, generator=g) > 0.5,
    }


async def _receive(engine: Any, step: int) -> list[tuple[str, str, list[int], bytes]]:
    """What the rollout worker got, as bytes (a queue would hand tensors over through shared memory)."""
    got = []
    async for name, t in engine.receive_weights(global_steps=step):
        got.append((name, str(t.dtype), list(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()))
    return got


def _walk(step: int, walked: list[str]):
    """An actor rank's weights generator, noting each weight it hands out."""
    for name, t in weights(step).items():
        walked.append(name)
        yield name, t


def _role(role: str, inbox: Any, outbox: Any) -> None:
    try:
        from relay.trainers.verl_ppo.cpu.gloo_checkpoint_engine import GlooCheckpointEngine

        engine = GlooCheckpointEngine(bucket_size=BUCKET, is_master=role == "actor0")
        for step in STEPS:
            outbox.put(("metadata", role, engine.prepare()))
            engine.init_process_group(**inbox.get(timeout=TIMEOUT))
            if role == "rollout":
                outbox.put(("received", role, asyncio.run(_receive(engine, step))))
            else:
                walked: list[str] = []
                asyncio.run(engine.send_weights(_walk(step, walked), global_steps=step))
                outbox.put(("walked", role, walked))
            engine.finalize()
    except Exception:
        outbox.put(("error", role, traceback.format_exc()))
        raise


def _from_bytes(dtype: str, shape: list[int], data: bytes) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype.removeprefix("torch."))).reshape(shape)


def test_two_syncs_arrive_bitwise_over_rebuilt_groups():
    from relay.trainers.verl_ppo.cpu.gloo_checkpoint_engine import GlooCheckpointEngine

    ctx = mp.get_context("spawn")
    # A queue each way per role: each role's messages come in its own order, whatever the order between roles.
    inboxes = {role: ctx.Queue() for role in ROLES}
    outboxes = {role: ctx.Queue() for role in ROLES}
    procs = [ctx.Process(target=_role, args=(role, inboxes[role], outboxes[role]), daemon=True) for role in ROLES]
    for p in procs:
        p.start()

    def next_message(role: str, kind: str) -> tuple[str, Any]:
        got_kind, _, payload = outboxes[role].get(timeout=TIMEOUT)
        if got_kind == "error":
            # the first failure is often a peer's broken connection: show every role's error
            time.sleep(2)
            errors = {role: payload}
            for other, box in outboxes.items():
                while not box.empty():
                    kind, _, text = box.get()
                    if kind == "error":
                        errors[other] = text
            pytest.fail("\n".join(f"{r} failed:\n{text}" for r, text in errors.items()))
        assert got_kind == kind, (role, got_kind)
        return role, payload

    try:
        for step in STEPS:
            metadata = dict(next_message(role, "metadata") for role in ROLES)
            actor_kwargs, rollout_kwargs = GlooCheckpointEngine.build_topology(
                2, 1, [metadata["actor0"], metadata["actor1"], metadata["rollout"]]
            )
            assert actor_kwargs["rank"] == [0, -1] and rollout_kwargs["rank"] == [1]
            assert actor_kwargs["world_size"] == [2, 2] and rollout_kwargs["world_size"] == [2]
            for role, kwargs, i in (
                ("actor0", actor_kwargs, 0),
                ("actor1", actor_kwargs, 1),
                ("rollout", rollout_kwargs, 0),
            ):
                inboxes[role].put({k: v[i] for k, v in kwargs.items()})

            results = dict(next_message(role, "received" if role == "rollout" else "walked") for role in ROLES)
            expected = weights(step)
            assert results["actor0"] == results["actor1"] == list(expected)  # every actor rank walked every weight
            received = results["rollout"]
            assert [name for name, *_ in received] == list(expected)
            for name, dtype, shape, data in received:
                got, want = _from_bytes(dtype, shape, data), expected[name]
                assert got.dtype == want.dtype and got.shape == want.shape, (step, name, got.dtype, got.shape)
                assert torch.equal(got, want), (step, name)
        assert not torch.equal(weights(1)["big.f32"], weights(2)["big.f32"])  # the second sync carried new values
        for p in procs:
            p.join(timeout=TIMEOUT)
            assert p.exitcode == 0, (p.name, p.exitcode)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()


def test_registry_resolves_gloo():
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    from relay.trainers.verl_ppo.cpu.gloo_checkpoint_engine import GlooCheckpointEngine, register_gloo_checkpoint_engine

    register_gloo_checkpoint_engine()
    register_gloo_checkpoint_engine()  # a second import of the cpu platform: no error, the same class
    assert CheckpointEngineRegistry.get("gloo") is GlooCheckpointEngine
    # verl's actor worker builds its engine with is_master; the rollout side with bucket_size alone
    engine = CheckpointEngineRegistry.new("gloo", is_master=True, bucket_size=1 << 20)
    assert isinstance(engine, GlooCheckpointEngine) and engine.bucket_size == 1 << 20
    assert engine.prepare().master is not None
    assert CheckpointEngineRegistry.new("gloo", bucket_size=1 << 20).prepare().master is None
    assert GlooCheckpointEngine.wire_format == "named_tensors"
