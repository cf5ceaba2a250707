"""The pickles of verl's TransferQueue state in a checkpoint (`transfer_queue/`), read without running code.

verl's async trainers save their TransferQueue with every checkpoint: the controller's `controller_state.pkl` and
each storage unit's `simple_storage/su_*.pkl` (with SSD offload, a `.blobs/` folder beside it whose values are raw
bytes or, for the values with no raw form, pickles). At a resume the queue's controller and storage actors read
them with `pickle.load`, which runs whatever a pickle names. So the gate reads every pickle there first with a
restricted unpickler, whose allow-list is what the queue writes:

- containers and scalars: builtins' set, frozenset, list, dict, tuple, bytearray, complex, slice; collections'
  OrderedDict, defaultdict, deque, Counter;
- the queue's own records: `DataPartitionStatus` and `FieldMeta` (dataclasses: restored by setting fields);
- tensors: torch's `_rebuild_tensor_v2` (no backward hooks), `torch.Size`, `torch.device` and the dtypes. A
  tensor's storage is pickled as `torch.storage._load_from_bytes(b)`, which is `torch.load(b,
  weights_only=False)`: it is replaced by torch's reader of those bytes over this same restricted unpickler, which
  resolves no global at all (torch's own `weights_only=True` cannot read a bare storage: it fails on
  `UntypedStorage.dtype`);
- numpy arrays and scalars (`_reconstruct`, `ndarray`, `dtype`, `scalar`, `_frombuffer`); an object array's
  items go through the allow-list like everything else;
- tensordict's `TensorDict`, `NonTensorData` and `NonTensorStack`, rebuilt by `_make_td` only for those classes.

Anything else (a function, a module's attribute, a class not listed) is refused with the name it asked for, and
nothing in the file runs: the checkpoint is quarantined with that reason. A resume loads only bytes the gate
validated (relay.checkpoints.manifest.unchanged_since_validation).
"""

from __future__ import annotations

import io
import pickle
from functools import cache
from pathlib import Path
from typing import Any

from relay.common.errors import CheckpointError, UnsafeCheckpointError

FOLDER = "transfer_queue"
_PROTOCOLS = range(2, 6)
_HYBRID_FORMAT_KEY = "ssd_index"  # a storage unit saved with SSD offload: values in `<file>.blobs/`


def is_queue_pickle(rel: str, head: bytes) -> bool:
    """A file of a step folder that verl's TransferQueue unpickles: under transfer_queue/, a pickle by its first
    bytes (whatever its name), and not an SSD blob (a blob's codec, in its storage unit's pickle, says whether it
    is one: `load` of that storage unit reads those)."""
    parts = Path(rel).parts
    return (
        FOLDER in parts
        and not any(p.endswith(".blobs") for p in parts)
        and len(head) >= 2
        and head[0] == 0x80
        and head[1] in _PROTOCOLS
    )


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _allowed().get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"persistent id {str(pid)[:40]!r}")


class _StorageUnpickler(pickle.Unpickler):
    # torch's legacy reader subclasses its pickle module's Unpickler, maps storage types itself and sets its own
    # persistent_load (the storage's bytes, read as raw data); any other global comes here, and none is allowed.
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}")


class _StorageModule:
    """What torch.load asks of a `pickle_module`."""

    Unpickler = _StorageUnpickler

    @staticmethod
    def load(file: Any, **kwargs: Any) -> Any:
        return _StorageUnpickler(file, **kwargs).load()


def _storage_from_bytes(b: bytes) -> Any:
    """torch.storage._load_from_bytes, over an unpickler that resolves no global (torch maps the storage types)."""
    import torch

    if not isinstance(b, bytes | bytearray):
        raise pickle.UnpicklingError("torch.storage._load_from_bytes with something other than bytes")
    return torch.load(io.BytesIO(b), weights_only=False, pickle_module=_StorageModule, map_location="cpu")


def _rebuild_tensor_v2(
    storage: Any, offset: int, size: Any, stride: Any, requires_grad: bool, hooks: Any, *rest: Any
) -> Any:
    """torch's, for a storage and without backward hooks (callables: a queue never saves any)."""
    import torch

    if hooks:
        raise pickle.UnpicklingError("torch._utils._rebuild_tensor_v2 with backward hooks")
    if not isinstance(storage, torch.storage.TypedStorage | torch.UntypedStorage):
        raise pickle.UnpicklingError("torch._utils._rebuild_tensor_v2 of something other than a storage")
    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks, *rest)


@cache
def _allowed() -> dict[str, Any]:
    import collections

    import numpy as np
    import torch
    from numpy._core.multiarray import _reconstruct, scalar
    from numpy._core.numeric import _frombuffer  # type: ignore[attr-defined]  # private, what numpy pickles
    from tensordict import NonTensorData, NonTensorStack, TensorDict
    from tensordict._reductions import _make_td
    from transfer_queue.controller import DataPartitionStatus, FieldMeta

    td_classes = (TensorDict, NonTensorData, NonTensorStack)

    def make_td(cls: Any, state: Any) -> Any:
        if cls not in td_classes:
            raise pickle.UnpicklingError(f"tensordict._reductions._make_td of {cls!r}")
        return _make_td(cls, state)

    allowed: dict[str, Any] = {
        f"builtins.{t.__name__}": t for t in (set, frozenset, list, dict, tuple, bytearray, complex, slice)
    }
    allowed |= {f"collections.{t.__name__}": t for t in (collections.OrderedDict, collections.defaultdict)}
    allowed |= {f"collections.{t.__name__}": t for t in (collections.deque, collections.Counter)}
    allowed |= {f"transfer_queue.controller.{t.__name__}": t for t in (DataPartitionStatus, FieldMeta)}
    allowed |= {
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch.storage._load_from_bytes": _storage_from_bytes,
        "torch.Size": torch.Size,
        "torch.device": torch.device,
    }
    allowed |= {f"torch.{n}": v for n in dir(torch) if isinstance(v := getattr(torch, n, None), torch.dtype)}
    for core in ("numpy._core", "numpy.core"):  # numpy 2 pickles numpy._core; numpy 1's files say numpy.core
        allowed |= {
            f"{core}.multiarray._reconstruct": _reconstruct,
            f"{core}.multiarray.scalar": scalar,
            f"{core}.numeric._frombuffer": _frombuffer,
        }
    allowed |= {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    allowed |= {f"numpy.dtypes.{n}": getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")}
    allowed |= {
        "tensordict._reductions._make_td": make_td,
        "tensordict._td.TensorDict": TensorDict,
        "tensordict.tensorclass.NonTensorData": NonTensorData,
        "tensordict.tensorclass.NonTensorStack": NonTensorStack,
    }
    return allowed


def loads(data: bytes, what: str) -> Any:
    """Unpickle `data` (`what` names it in errors) through the allow-list; UnsafeCheckpointError names a refused type."""
    try:
        return _Restricted(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{what} is unsafe: unpickling it needs {e}, which is not a type verl's TransferQueue writes and could "
            "run code; nothing in it was executed",
            "do not resume from this checkpoint: resume from an earlier one (the run falls back by itself), and "
            "find who wrote this file",
        ) from None
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - damaged bytes fail the unpickler in any way
        raise CheckpointError(
            f"{what} cannot be unpickled ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
            "the file is damaged; resume from an earlier checkpoint",
        ) from None


def load(path: Path) -> Any:
    """One of the queue's pickles, restricted; a storage unit saved with SSD offload has its pickled blobs checked too."""
    path = Path(path)
    state = loads(path.read_bytes(), str(path))
    if isinstance(state, dict) and isinstance(index := state.get(_HYBRID_FORMAT_KEY), dict):
        _check_blobs(path, index)
    return state


def _check_blobs(path: Path, index: dict[Any, Any]) -> None:
    """The blobs of an SSD-offloaded storage unit whose codec is pickle (the queue unpickles those as it reads them)."""
    blobs = Path(f"{path}.blobs")
    for entries in index.values():
        for meta in entries.values() if isinstance(entries, dict) else ():
            if not isinstance(meta, dict) or meta.get("codec") != "pickle":
                continue
            name = str(meta.get("filename"))
            if Path(name).name != name:
                raise UnsafeCheckpointError(
                    f"{path} names a blob outside its folder ({name!r})",
                    "do not resume from this checkpoint: resume from an earlier one",
                )
            loads((blobs / name).read_bytes(), str(blobs / name))
