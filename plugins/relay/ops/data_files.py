"""What a person does to training data from a terminal (`relay data ...`): the quality suite on a parquet file,
its freeze into S3 under its sha256, and what changed between two files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relay.data import quality
from relay.data.diff import DataDiff, diff
from relay.data.fingerprint import fingerprint
from relay.s3.store import CheckpointStore


def check(parquet: str, *, min_rows: int, suites: list[str]) -> quality.QualityReport:
    """The verl RL data-quality suite (great-expectations) on a parquet file, with the expectations of `suites`."""
    extra = [e for f in suites for e in quality.load_expectations(Path(f))]
    return quality.check(parquet, min_rows=min_rows, extra=extra)


def freeze(parquet: str, store: CheckpointStore) -> dict[str, Any]:
    """Fingerprint a parquet file and upload it to <prefix>/data/<sha256>.parquet: its sha256, size, rows and URI."""
    fp = fingerprint(parquet)
    uri = store.put_file("/".join(p for p in (store.prefix, "data", f"{fp.sha256}.parquet") if p), Path(parquet))
    return {"sha256": fp.sha256, "size": fp.size, "rows": fp.rows, "frozen_uri": uri}


def compare(a: str, b: str) -> DataDiff:
    """What changed from file `a` to file `b`."""
    return diff(a, b)
