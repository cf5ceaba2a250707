"""A verl checkpoint's model as its shards hold it, at any world size and FSDP version, read without a process group.

Every rank's `actor/model_world_size_W_rank_R.pt` is read with the restricted loader (relay.checkpoints.safeload):
FSDP2's DTensors are pieces along dim 0 in rank order, FSDP1's ShardedTensor records pieces at their shards'
offsets, a plain tensor (world size 1) is whole. From the pieces: each tensor's certificate digest
(relay.checkpoints.certificate: a sum over pieces at their global flat offsets, so nothing is gathered), and, for a
model small enough to hold, the whole tensors. The gate's offline certificate and smoke checks and the Hugging Face
export's verification read a checkpoint through here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.checkpoints import certificate, safeload


@dataclass
class ModelShards:
    pieces: dict[str, list[tuple[Any, int]]]  # name -> (piece, its global flat offset), every rank's
    shapes: dict[str, tuple[int, ...]]  # name -> the tensor's global shape
    world_size: int
    nbytes: int  # the shard files' size on disk

    def digests(self, names: Any = None) -> dict[str, str]:
        """certificate.digests of the tensors (`names`, default all), each one's pieces summed."""
        wanted = self.pieces if names is None else {n: self.pieces[n] for n in names if n in self.pieces}
        return summed_digests(wanted)

    def full(self, dtype: Any = None) -> dict[str, Any]:
        """Every tensor whole (in `dtype`, default as stored): its pieces placed at their offsets."""
        import torch

        out = {}
        for name, pieces in self.pieces.items():
            first = pieces[0][0]
            flat = torch.empty(math.prod(self.shapes[name]), dtype=dtype or first.dtype)
            for piece, offset in pieces:
                flat[offset : offset + piece.numel()] = piece.reshape(-1).to(flat.dtype)
            out[name] = flat.view(self.shapes[name])
        return out


def read(step_dir: Path) -> ModelShards:
    """The model shards of a verl checkpoint's actor (see the module's docstring)."""
    files = sorted(
        (Path(step_dir) / "actor").glob("model_world_size_*_rank_*.pt"), key=lambda p: int(p.stem.rpartition("_")[2])
    )
    pieces: dict[str, list[tuple[Any, int]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for rank, shard in enumerate(files):
        for name, value in safeload.load(shard, mmap=True).items():
            got = pieces.setdefault(name, [])
            if safeload.is_sharded_record(value):
                shapes[name] = value.global_shape
                row = math.prod(value.global_shape[1:])
                got.extend((s.tensor, s.metadata.shard_offsets[0] * row) for s in value.local_shards)
            elif hasattr(value, "to_local"):
                shapes[name] = tuple(value.shape)  # a DTensor's shape is the global one
                local = value.to_local()
                got.append((local, sum(t.numel() for t, _ in got)))  # Shard(0): the ranks' rows in order
            elif rank == 0:
                shapes[name] = tuple(value.shape)
                got.append((value, 0))
    return ModelShards(pieces, shapes, len(files), sum(f.stat().st_size for f in files))


def summed_digests(pieces: dict[str, list[tuple[Any, int]]]) -> dict[str, str]:
    """certificate.digests of tensors given as pieces at their global flat offsets: each one's pieces summed."""
    flat = [(n, p) for n, ps in pieces.items() for p in ps]
    sums = certificate.piece_sums([p for _, p in flat])
    total: dict[str, int] = dict.fromkeys(pieces, 0)
    for (n, _), v in zip(flat, sums, strict=True):
        total[n] = (total[n] + v) & ((1 << 64) - 1)
    return {n: f"{v:016x}" for n, v in total.items()}
