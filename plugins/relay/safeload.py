"""Restricted reading of checkpoint .pt files: never unpickle arbitrary objects.

verl loads its shards and data.pt with torch.load(weights_only=False), which runs whatever code a
pickle names. A checkpoint on shared storage can carry such code. Relay reads every .pt through
torch.load(weights_only=True) with a short allow-list (what verl's RNG state needs), memory-mapped
so a large shard costs little memory. A file that needs anything else is refused as unsafe.
"""

from __future__ import annotations

import logging
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any

from relay.errors import CheckpointError, UnsafeCheckpointError


def allowed_globals() -> list:
    """What verl's extra_state (numpy RNG state) needs beyond plain tensors and containers."""
    import numpy as np

    return [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def check_zip(path: Path) -> None:
    """Verify the CRC32 of every entry in a .pt (zip) file: torch.load alone accepts altered tensor bytes."""
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{path} is not a complete torch file ({e}); it may be truncated",
                              "resume from an older checkpoint") from None
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e})", "check the storage") from None
    if bad is not None:
        raise CheckpointError(f"{path}: entry {bad} fails its CRC32 check (the bytes were altered)",
                              "resume from an older checkpoint")


def load(path: str | Path, *, mmap: bool = True, verify_crc: bool = True) -> Any:
    """Load a checkpoint .pt safely (tensors, DTensors, containers and numpy RNG state only)."""
    import torch
    import torch.distributed.tensor  # noqa: F401  registers DTensor for weights_only loading (FSDP2 shards)

    path = Path(path)
    if verify_crc:
        check_zip(path)
    # Unpickling a DTensor outside its process group makes torch warn about DeviceMesh on every file.
    logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
    try:
        with torch.serialization.safe_globals(allowed_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        m = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(e))
        wanted = m.group(1) if m else "an object outside the allow-list"
        raise UnsafeCheckpointError(
            f"{path} is unsafe: loading it needs {wanted}, which could run code; nothing in it was executed",
            "do not load this file; if you wrote it yourself, save plain tensors and containers only",
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be loaded ({str(e).splitlines()[0]})",
                              "the file is damaged; resume from an older checkpoint") from None
