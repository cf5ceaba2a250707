"""Saves off the critical path (`checkpoints.async_save`): the trainer copies what a save writes into host buffers
and trains on while a thread writes the copy.

The copy is taken on the trainer's main thread, through the trainer's own save code (verl's
FSDPCheckpointManager.save_checkpoint, its barriers included) with the `torch.save` of that module deferred, and only
while it saves (DeferredWrites.intercepting): each object it would
write is mirrored, storage by storage, into buffers kept from one save to the next (a fresh copy per save pays page
faults that cost more than half a synchronous save), and the writes are replayed later by the save's thread.
Each storage is copied once, whole, as torch.save writes it, and every tensor of the object is remade over its
copy at its own offset, size and stride: tensors that share a storage (tied embeddings, views) stay shared. The
mirror keeps every tensor's type, sharding spec (a DTensor's own spec object, whose cached hash is pickled),
`requires_grad` and a state dict's `_metadata`, so the files are byte for byte those of a synchronous save.

The session (relay.trainers.session) keeps at most one save in flight, commits it under the lease only after
its files are written and fsynced, and waits for it before the next save, the chunk's end or the process's.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

GiB = 2**30
MEMORY_MARGIN = 1 * GiB  # what the buffers leave free on the host, at least


class HostBuffers:
    """Buffers for the storages of the objects a save writes, keyed by the file's name and the storage's place in the
    object (the order torch.save meets them in), allocated once and reused while their sizes stay the same."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, Any] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def missing_bytes(self, key: str, obj: Any) -> int:
        """What mirroring `obj` would allocate anew."""
        return sum(
            size for place, size in _storages(obj, key) if (buf := self._buffers.get(place)) is None or buf.numel() != size
        )

    def mirror(self, key: str, obj: Any) -> Any:
        return self._mirror(obj, _Copied(key))

    def _mirror(self, x: Any, copied: _Copied) -> Any:
        import torch

        if not isinstance(x, torch.Tensor):
            return self._mirror_one(x, copied)
        # one object under two names (tied embeddings) is one object in the copy too: pickled once, as torch.save does
        if id(x) not in copied.tensors:
            copied.tensors[id(x)] = (x, self._mirror_one(x, copied))  # x kept alive: its id stays its own
        return copied.tensors[id(x)][1]

    def _mirror_one(self, x: Any, copied: _Copied) -> Any:
        import torch
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor):
            local = self._copy(x._local_tensor, copied)
            out: Any = DTensor(local, x._spec, requires_grad=x.requires_grad)
            return torch.nn.Parameter(out, requires_grad=x.requires_grad) if isinstance(x, torch.nn.Parameter) else out
        if isinstance(x, torch.Tensor):
            out = self._copy(x, copied)
            if isinstance(x, torch.nn.Parameter):
                return torch.nn.Parameter(out, requires_grad=x.requires_grad)
            return out.requires_grad_(x.requires_grad) if x.requires_grad else out
        if isinstance(x, dict):
            d = type(x)((k, self._mirror(v, copied)) for k, v in x.items())
            if hasattr(x, "_metadata"):  # a state dict's: pickled with it
                d._metadata = x._metadata  # type: ignore[attr-defined]
            return d
        if isinstance(x, (list, tuple)):
            items = [self._mirror(v, copied) for v in x]
            return items if isinstance(x, list) else type(x)(items) if not hasattr(x, "_fields") else type(x)(*items)
        return x  # numbers, strings, None: immutable, taken as they are

    def _copy(self, t: Any, copied: _Copied) -> Any:
        """`t` over the copy of its storage (the storage copied once per object, whole, the first time it is met)."""
        import torch

        src = t.untyped_storage()
        host = copied.storages.get(src._cdata)  # torch.save tells storages apart the same way
        if host is None:
            place = (copied.key, len(copied.storages))
            buf = self._buffers.get(place)
            if buf is None or buf.numel() != src.nbytes():
                # Pinned where a GPU is: the copy from the device then runs at full speed.
                pin = src.device.type == "cuda" and torch.cuda.is_available()
                buf = torch.empty(src.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
                self._buffers[place] = buf
            buf.copy_(torch.empty(0, dtype=torch.uint8, device=src.device).set_(src), non_blocking=False)
            host = copied.storages[src._cdata] = buf.untyped_storage()
        return torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())


@dataclass
class _Copied:
    """One object's mirroring: its storages copied so far (by torch's storage identity) and its tensors remade."""

    key: str  # the file's folder and name (actor/model_world_size_1_rank_0.pt: a critic's file has the same name)
    storages: dict[int, Any] = field(default_factory=dict)
    tensors: dict[int, tuple[Any, Any]] = field(default_factory=dict)


def _storages(x: Any, key: str) -> Iterator[tuple[tuple, int]]:
    """(the buffer's place, its size in bytes) of every storage of `x`, once each, in the order the mirror meets them."""
    import torch
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()

    def walk(x: Any) -> Iterator[tuple[tuple, int]]:
        if isinstance(x, DTensor):
            x = x._local_tensor
        if isinstance(x, torch.Tensor):
            src = x.untyped_storage()
            if src._cdata not in seen:
                yield (key, len(seen)), src.nbytes()
                seen.add(src._cdata)
        elif isinstance(x, dict):
            for v in x.values():
                yield from walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                yield from walk(v)

    return walk(x)


class NoRoomForCopy(Exception):
    """The host buffers a save's copy needs do not fit in the host's available memory: that save is synchronous."""


class DeferredWrites:
    """The `torch.save` calls of a save, collected while it runs on the main thread (see the module docstring).
    when_no_room: what a copy that does not fit in the host's memory does: "raise" NoRoomForCopy (the whole save is
    then made synchronously), or "write" that object at once (named in `written_now`), where raising in one process
    would leave the others waiting at a barrier (verl's workers)."""

    def __init__(self, buffers: HostBuffers, when_no_room: str = "raise"):
        self.buffers = buffers
        self.when_no_room = when_no_room
        self.writes: list[tuple[Any, Path]] = []
        self.written_now: list[str] = []

    def save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        """torch.save, deferred: `obj` mirrored into the host buffers, to be written by `write`. Anything but a plain
        save to a path, or a copy that does not fit, is written now."""
        import torch

        if args or kwargs or not isinstance(f, (str, Path)):
            return torch.save(obj, f, *args, **kwargs)  # not a plain save to a file: as asked, now
        key = buffer_key(Path(f))
        if (short := no_room_for(self.buffers.missing_bytes(key, obj))) is not None:
            if self.when_no_room != "write":
                raise NoRoomForCopy(f"the host copy of {key} {short}")
            self.written_now.append(f"{key}: its host copy {short}")
            return torch.save(obj, f)
        self.writes.append((self.buffers.mirror(key, obj), Path(f)))
        return None

    @contextlib.contextmanager
    def intercepting(self, *checkpoint_managers: Any) -> Iterator[DeferredWrites]:
        """While the block runs, each call of a manager's `save_checkpoint` (verl's FSDPCheckpointManager: an actor's,
        a critic's in the same process) runs with the `torch.save` of its own module deferred into this object;
        nothing else in the process, not even that module outside the call, sees another torch.save. The module's
        global `torch` is a view of torch whose `save` is `self.save` for the length of the call (verl calls
        `torch.save` through it)."""
        import torch

        view = _TorchWithSave(torch, self.save)
        wrapped = []
        try:
            for manager in checkpoint_managers:
                module = sys.modules[type(manager).__module__]
                if id(vars(module).get("torch")) != id(torch):  # (compared by id: mypy would narrow `torch` itself)
                    raise RuntimeError(
                        f"{module.__name__} does not call torch.save through its global `torch`: the async save "
                        "cannot defer its writes (relay.trainers.verl_ppo.verl_contract lists what it relies on)"
                    )
                manager.save_checkpoint = _deferring(manager.save_checkpoint, module, view, torch)  # this object's
                wrapped.append(manager)
            yield self
        finally:
            for manager in wrapped:
                del manager.save_checkpoint  # verl's own method again

    def copied(self, name: str) -> Any:
        """The copy of what was to be saved as file `name` (None if nothing was)."""
        return next((obj for obj, path in self.writes if path.name == name), None)

    def write(self, before: Callable[[Path], Any] | None = None) -> None:
        """Replay the collected saves (the save's thread); `before(path)` runs before each (a fault point)."""
        import torch

        for obj, path in self.writes:
            if before is not None:
                before(path)
            torch.save(obj, path)


def _deferring(saving: Callable[..., Any], module: ModuleType, view: ModuleType, torch: ModuleType) -> Callable[..., Any]:
    """`saving` (a bound save_checkpoint) run with `module`'s global `torch` swapped for `view`, only for the call."""

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        module.torch = view  # type: ignore[attr-defined]
        try:
            return saving(*args, **kwargs)
        finally:
            module.torch = torch  # type: ignore[attr-defined]

    return save_checkpoint


def buffer_key(path: Path) -> str:
    """A saved file's place in the host buffers, the same from one save to the next: its role's folder and its name
    for a shard (an actor's and a critic's share names), its name for a file of the step's own (data.pt)."""
    from relay.runs import layout

    return f"{path.parent.name}/{path.name}" if path.parent.name in layout.ROLES else path.name


class _TorchWithSave(types.ModuleType):
    """torch, with another `save`: what verl's checkpoint manager's module sees while a deferred save runs."""

    def __init__(self, torch: ModuleType, save: Callable[..., Any]) -> None:
        super().__init__("torch")
        self.__torch = torch
        self.save = save

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__torch, name)


def no_room_for(need: int) -> str | None:
    """Why `need` more bytes of host buffers do not fit beside the host's available memory (less MEMORY_MARGIN),
    in words ("needs ... GiB more ..."); None when they fit or the memory cannot be read."""
    free = available_memory()
    if not need or free is None or need <= free - MEMORY_MARGIN:
        return None
    return (
        f"needs {need / GiB:.2f} GiB more of host buffers, and {free / GiB:.2f} GiB are available "
        f"(less {MEMORY_MARGIN / GiB:.0f} GiB kept free)"
    )


def available_memory() -> int | None:
    """The host's available memory in bytes (MemAvailable), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def prepare(buffers: HostBuffers, ckpts: dict[str, Any]) -> str:
    """Allocate (and touch) the buffers for what verl's FSDPCheckpointManagers save, each into its step folder
    (`ckpts`: {"actor": ..., "critic": ...}), before the first step: the models' states, and the optimizers' once they
    have one (a run's first save allocates those). What it did, in words; nothing when the buffers would not fit in
    the host's memory (each save that cannot copy then writes at once)."""
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
    from verl.utils.device import is_cuda_available
    from verl.utils.fsdp_utils import get_fsdp_state_ctx

    from relay.runs import layout

    states = {}
    with contextlib.ExitStack() as stack:
        for folder, ckpt in ckpts.items():
            stack.enter_context(
                get_fsdp_state_ctx(
                    ckpt.model,
                    StateDictType.SHARDED_STATE_DICT,
                    ShardedStateDictConfig(offload_to_cpu=bool(is_cuda_available)),  # as verl's save asks for them
                    ShardedOptimStateDictConfig(offload_to_cpu=bool(is_cuda_available)),
                )
            )
            states[f"{folder}/{layout.shard_name('model', ckpt.world_size, ckpt.rank)}"] = ckpt.model.state_dict()
            if ckpt.optimizer is not None and ckpt.optimizer.state:
                optim = f"{folder}/{layout.shard_name('optim', ckpt.world_size, ckpt.rank)}"
                states[optim] = ckpt.optimizer.state_dict()
        short = no_room_for(sum(buffers.missing_bytes(k, v) for k, v in states.items()))
        if short is not None:
            return (
                f"saves off the critical path (checkpoints.async_save): the state {short}: each save that cannot "
                "copy is synchronous"
            )
        for key, state in states.items():
            buffers.mirror(key, state)
    size = f"{buffers.nbytes / GiB:.3f} GiB" if buffers.nbytes >= GiB / 10 else f"{buffers.nbytes / 2**20:.1f} MiB"
    roles = f" ({' and '.join(ckpts)})" if len(ckpts) > 1 else ""
    return (
        f"saves off the critical path (checkpoints.async_save): {size} of host buffers{roles} allocated before the "
        "first step"
    )
