"""Restricted reading of checkpoint .pt files: never unpickle arbitrary objects.

verl loads its shards and data.pt with torch.load(weights_only=False), which runs whatever code a
pickle names. A checkpoint on shared storage can carry such code. Relay reads every .pt through
torch's own weights_only unpickler, memory-mapped, with a short allow-list:

- numpy's RNG state, which verl's extra_state holds;
- FSDP2 shards are DTensors, which torch allows once torch.distributed.tensor is imported;
- FSDP1 shards at world size > 1 are ShardedTensors, whose unpickling needs the writer's process
  group. They are read as ShardedTensorRecord (local shards + metadata, inert) through the
  allow-list's substitution mechanism, so no process group is needed and nothing runs.

A file that needs anything else is refused as unsafe, and nothing in it is executed.
"""

from __future__ import annotations

import logging
import pickle
import re
import threading
from pathlib import Path
from typing import Any, NoReturn, Self

from relay.common.errors import CheckpointError, UnsafeCheckpointError

_ALLOWED: list[object] | None = None
_SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


def _stand_ins() -> tuple[type[Any], type[object]]:
    import torch

    class ShardedTensorRecord(torch.Tensor):  # type: ignore[misc]  # torch is not analysed: its Tensor is Any
        """What an FSDP1 ShardedTensor holds (local shards, global metadata), without its process group."""

        local_shards: list[Any]
        metadata: Any

        def __setstate__(self, state: tuple[Any, ...]) -> None:
            self.local_shards, self.metadata = state[0], state[1]

        @classmethod
        def __torch_dispatch__(
            cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
        ) -> NoReturn:
            raise RuntimeError("a ShardedTensorRecord is for inspection only; load the shard in its process group")

        @property
        def global_shape(self) -> tuple[int, ...]:
            return tuple(self.metadata.size)

    class ProcessGroupStateRecord:
        """ShardedTensor.ProcessGroupState (ranks and world sizes at save time), inert."""

        args: tuple[Any, ...]
        state: Any

        def __new__(cls, *args: Any) -> Self:
            obj = object.__new__(cls)
            obj.args = args
            return obj

        def __setstate__(self, state: Any) -> None:
            self.state = state

    return ShardedTensorRecord, ProcessGroupStateRecord


def allowed_globals() -> list[object]:
    """What verl's files need beyond plain tensors and containers (torch's own weights_only defaults)."""
    global _ALLOWED
    if _ALLOWED is None:
        import numpy as np
        from numpy._core.multiarray import _reconstruct
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor.metadata import (
            MEM_FORMAT_ENCODING,
            ShardedTensorMetadata,
            TensorProperties,
        )
        from torch.distributed._shard.sharded_tensor.shard import Shard
        from torch.distributed._shard.sharding_spec.chunk_sharding_spec import ChunkShardingSpec
        from torch.distributed.remote_device import _remote_device

        record, pg_state = _stand_ins()

        def restricted_getattr(obj: Any, name: str) -> object:
            # ShardedTensor pickles two attribute lookups; any other getattr is refused.
            if obj is record and name == "ProcessGroupState":
                return pg_state
            if obj is MEM_FORMAT_ENCODING and name in MEM_FORMAT_ENCODING.__members__:
                return MEM_FORMAT_ENCODING[name]
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL getattr({obj!r}, {name!r})")

        _ALLOWED = [
            _reconstruct,
            np.ndarray,
            np.dtype,
            np.dtypes.UInt32DType,
            Shard,
            ShardMetadata,
            ShardedTensorMetadata,
            TensorProperties,
            MEM_FORMAT_ENCODING,
            ChunkShardingSpec,
            _remote_device,
            pg_state,
            (record, _SHARDED_TENSOR),
            (restricted_getattr, "builtins.getattr"),
        ]
    return _ALLOWED


_REGISTERED = threading.Lock()
_registered = False


def _register() -> None:
    """Add the allow-list to torch's safe globals once per process. (The safe_globals context manager
    is not thread-safe: one thread leaving it removes the globals another thread is loading with.)"""
    global _registered
    with _REGISTERED:
        if not _registered:
            import torch

            torch.serialization.add_safe_globals(allowed_globals())
            _registered = True


def is_sharded_record(value: Any) -> bool:
    return hasattr(value, "local_shards") and hasattr(value, "metadata")


def load(path: str | Path, *, mmap: bool = True) -> Any:
    """Load a checkpoint .pt safely. Integrity (CRC, checksums) is integrity.py's job, not this one's."""
    import torch
    import torch.distributed.tensor

    # Unpickling a DTensor outside its process group makes torch warn about DeviceMesh on every file.
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    path = Path(path)
    _register()
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        m = re.search(r"GLOBAL ([\w.]+(?:\([^)]*\))?)", str(e))
        wanted = m.group(1) if m else "an object outside the allow-list"
        raise UnsafeCheckpointError(
            f"{path} is unsafe: loading it needs {wanted}, which could run code; nothing in it was executed",
            "do not load this file; if you wrote it yourself, save plain tensors and containers only",
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{path} cannot be loaded ({str(e).splitlines()[0]})", "the file is damaged; resume from an older checkpoint"
        ) from None
