"""A parquet file's fingerprint: sha256 of its bytes (streamed, bounded memory), row count and schema.

The same bytes give the same fingerprint on any machine; any byte change gives a new one.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relay.common.errors import RelayError

BLOCK = 8 << 20


class DataError(RelayError):
    """Training data is missing, unreadable, of poor quality, or changed under a run."""

    retry_helps = False


@dataclass(frozen=True)
class Fingerprint:
    sha256: str
    size: int
    rows: int
    schema: str  # the Arrow schema, as text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sha256_file(path: str | Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    buf = bytearray(BLOCK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
            size += n
    return h.hexdigest(), size


def fingerprint(path: str | Path) -> Fingerprint:
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}", "fix data.train_files / data.val_files in the run spec")
    digest, size = sha256_file(path)
    try:
        meta = pq.read_metadata(path)
        schema = pq.read_schema(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
        raise DataError(f"{path} is not a readable parquet file ({e})", "check the file") from None
    return Fingerprint(digest, size, meta.num_rows, schema.to_string(show_schema_metadata=False))
