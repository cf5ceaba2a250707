"""A verl checkpoint engine over torch's gloo: weight sync from the training workers to standalone rollout workers
on a machine without GPUs, registered as backend `gloo`.

verl 0.9.1's `separate_async` trainer runs its rollout in workers of their own and, after each sync step, has a
checkpoint engine carry the actor's weights to them. Its trainer refuses the colocated `naive` engine
(`verl/trainer/ppo/v1/trainer_separate_async.py:68`), and every other engine verl ships needs an accelerator
(nccl and nixl use cupy and CUDA buffers, mooncake RDMA, hccl an NPU). This one moves the same weights as bytes
over a gloo process group of its own.

The flow (verl's `CheckpointEngineManager.update_weights`), per sync:

1. `prepare()` on every actor and rollout worker. The master (actor rank 0: verl's actor worker builds its engine
   with `is_master=(torch.distributed.get_rank() == 0)`) starts a TCPStore on a free port and reports its address.
2. `build_topology()` in the trainer: one sender, as nccl's single-sender layout: actor rank 0 is rank 0, the other
   actor ranks -1 (outside the group), the rollout workers 1..n.
3. `init_process_group()` everywhere: a `ProcessGroupGloo` on that store, used directly. The training workers
   already have a default process group (gloo, for FSDP), which this must not replace.
4. `send_weights()` on every actor rank (each must walk the weights generator: producing a weight is a collective
   across the actor ranks), `receive_weights()` on every rollout worker.
5. `finalize()`: the group and the store are dropped; the next sync builds new ones.

Wire format, per bucket of at most `bucket_size` bytes: a header (int64 [json_len, data_len]), the bucket's
metadata as JSON bytes, then the bucket's bytes; a header [0, 0] ends the stream. A tensor larger than a bucket
travels in chunks, one bucket each. No pickle crosses the wire.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry, TensorMeta, merge_weight_chunks
from verl.workers.rollout.utils import ensure_async_iterator

logger = logging.getLogger(__name__)

BACKEND = "gloo"
# Every tensor starts at a multiple of this in its bucket, so the receiver can view the bytes as any dtype
# (viewing uint8 as float32 needs an offset divisible by 4; 16 covers complex128).
_ALIGN = 16
_DONE = (0, 0)  # the header that ends a sync's stream


@dataclass
class MasterMetadata:
    """Where the other ranks find the sender's TCPStore."""

    host: str
    port: int


@dataclass
class WorkerMetadata:
    """What `prepare()` reports; only the master (actor rank 0) fills `master`."""

    master: MasterMetadata | None = None


def _node_ip() -> str:
    if ray.is_initialized():
        return ray.util.get_node_ip_address().strip("[]")
    return "127.0.0.1"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"gloo checkpoint engine: the sender named dtype {name!r}, which this torch does not have")
    return dtype


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on the CPU (a copy only where the tensor is not already one)."""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


class GlooCheckpointEngine(CheckpointEngine):
    """Single-sender weight broadcast over a gloo group of its own (see the module's docstring).

    Args:
        bucket_size: most bytes per broadcast (verl passes `update_weights_bucket_megabytes << 20`). The sender
            packs into one buffer of this size; the receiver allocates each bucket at its actual length.
        is_master: set by verl on the actor worker of rank 0, which sends. Rollout workers leave it False.
        timeout_s: how long a rank waits on the store and on each broadcast before it fails.
        **kwargs: other `engine_kwargs`, ignored (logged).
    """

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 1800.0, **kwargs: Any) -> None:
        if bucket_size <= 0:
            raise ValueError(
                f"gloo checkpoint engine: bucket_size must be a positive number of bytes, got {bucket_size}; "
                "set checkpoint_engine.update_weights_bucket_megabytes"
            )
        if kwargs:
            logger.warning("gloo checkpoint engine ignores engine_kwargs %s", sorted(kwargs))
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.rank: int | None = None
        self.world_size: int | None = None
        self._store: Any = None  # the master's server from prepare(), or a client from init_process_group()
        self._group: Any = None

    def prepare(self) -> WorkerMetadata:
        if not self.is_master:
            return WorkerMetadata()
        host = _node_ip()
        # Port 0: the store binds a free port itself (no window between choosing a port and binding it). It listens
        # on every interface; the world size is not known yet, so it waits for no one here.
        self._store = dist.TCPStore(host, 0, None, True, timeout=self.timeout, wait_for_workers=False)
        return WorkerMetadata(master=MasterMetadata(host=host, port=self._store.port))

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[WorkerMetadata]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        master = metadata[0].master
        if master is None:
            raise RuntimeError(
                "gloo checkpoint engine: actor rank 0 reported no store from prepare(); its engine must be built "
                "with is_master=True (verl's actor worker does so on torch.distributed rank 0)"
            )
        world_size = 1 + rollout_world_size
        actor_kwargs: dict[str, list[Any]] = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world_size] * actor_wg_world_size,
            "master_metadata": [master] * actor_wg_world_size,
        }
        rollout_kwargs: dict[str, list[Any]] = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "master_metadata": [master] * rollout_world_size,
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, master_metadata: MasterMetadata) -> None:
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            return  # an actor rank outside the group: it only walks its weights generator
        if rank == 0:
            if self._store is None:
                raise RuntimeError("gloo checkpoint engine: rank 0 has no store; call prepare() on it first")
        else:
            self._store = dist.TCPStore(master_metadata.host, master_metadata.port, world_size, False, timeout=self.timeout)
        # Used directly, never registered as the default group: the actor's FSDP group stays as it is.
        self._group = dist.ProcessGroupGloo(self._store, rank, world_size, self.timeout)

    def finalize(self) -> None:
        self._group = None
        self._store = None
        self.rank = None
        self.world_size = None

    async def _broadcast(self, tensor: torch.Tensor) -> None:
        # In a thread: a broadcast waits on the other ranks, and the worker's event loop has other calls to serve.
        group = self._group
        await asyncio.to_thread(lambda: group.broadcast(tensor, 0).wait())

    async def send_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
    ) -> None:
        if self.rank is None:
            raise RuntimeError("gloo checkpoint engine: send_weights() before init_process_group()")
        if self.rank < 0:
            # Each weight is gathered across the actor ranks: rank 0 gets none unless every rank walks along.
            async for _ in ensure_async_iterator(weights):
                pass
            return
        if self.rank != 0:
            raise RuntimeError(f"gloo checkpoint engine: rank {self.rank} is a rollout worker, which only receives")

        bucket = torch.empty(self.bucket_size, dtype=torch.uint8)
        entries: list[dict[str, Any]] = []
        offset = 0

        async def flush() -> None:
            nonlocal entries, offset
            meta = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8)
            await self._broadcast(torch.tensor([meta.numel(), offset], dtype=torch.int64))
            await self._broadcast(meta)
            if offset:  # a bucket of tensors without elements has no bytes
                await self._broadcast(bucket[:offset])
            entries, offset = [], 0

        # Not verl's split_weight_chunks: it sends nothing of a tensor without elements, which the rollout then lacks.
        async for name, tensor in ensure_async_iterator(weights):
            data = _bytes(tensor)
            shape, dtype = list(tensor.shape), str(tensor.dtype).removeprefix("torch.")
            chunk_offset = 0
            while True:  # at least once: a tensor with no elements still sends its name, shape and dtype
                chunk_size = min(self.bucket_size, data.numel() - chunk_offset)
                start = -(-offset // _ALIGN) * _ALIGN
                if entries and start + chunk_size > self.bucket_size:
                    await flush()
                    start = 0
                bucket[start : start + chunk_size] = data[chunk_offset : chunk_offset + chunk_size]
                entries.append(
                    {
                        "name": name,
                        "shape": shape,
                        "dtype": dtype,
                        "chunk_offset": chunk_offset,
                        "chunk_size": chunk_size,
                        "offset": start,
                    }
                )
                offset = start + chunk_size
                chunk_offset += chunk_size
                if chunk_offset >= data.numel():
                    break
        if entries:
            await flush()
        await self._broadcast(torch.tensor(_DONE, dtype=torch.int64))

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        if self.rank is None or self.rank <= 0:
            raise RuntimeError(
                f"gloo checkpoint engine: receive_weights() on rank {self.rank}; only rollout workers (rank >= 1, "
                "after init_process_group()) receive"
            )
        # verl's own merge (as its nccl engine's): whole tensors as views of their bucket, chunks put together
        async for name, tensor in merge_weight_chunks(self._received_chunks(), self.bucket_size):
            yield name, tensor

    async def _received_chunks(self) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        """Each bucket's pieces, as verl's TensorMeta and bytes, until the sender's end of stream."""
        while True:
            header = torch.empty(2, dtype=torch.int64)
            await self._broadcast(header)
            json_len, data_len = (int(x) for x in header.tolist())
            if (json_len, data_len) == _DONE:
                return
            meta = torch.empty(json_len, dtype=torch.uint8)
            await self._broadcast(meta)
            # A bucket of its own per broadcast: the tensors yielded from it are views, owned by the receiver.
            bucket = torch.empty(data_len, dtype=torch.uint8)
            if data_len:
                await self._broadcast(bucket)
            for e in json.loads(meta.numpy().tobytes()):
                piece = TensorMeta(
                    e["name"], torch.Size(e["shape"]), _dtype(e["dtype"]), e["chunk_offset"], e["chunk_size"], e["offset"]
                )
                yield piece, bucket[piece.offset : piece.offset + piece.chunk_size]


def register_gloo_checkpoint_engine() -> None:
    """Registers GlooCheckpointEngine in verl's CheckpointEngineRegistry as `gloo` (verl's public register() and get());
    a no-op if `gloo` is taken."""
    try:
        CheckpointEngineRegistry.get(BACKEND)
    except ValueError:  # not registered yet
        CheckpointEngineRegistry.register(BACKEND)(GlooCheckpointEngine)
