"""What changed between two parquet files of verl's RL schema: schema, rows added, removed, changed
or reordered. Rows are matched by extra_info.index when it is there and unique, else by content."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.data.fingerprint import fingerprint

EXAMPLES = 5


@dataclass
class DataDiff:
    a: str
    b: str
    same_bytes: bool
    rows_a: int
    rows_b: int
    schema_changes: list[str] = field(default_factory=list)
    added: list[Any] = field(default_factory=list)  # keys of rows only in b
    removed: list[Any] = field(default_factory=list)  # keys of rows only in a
    changed: list[Any] = field(default_factory=list)  # keys present in both with other content
    reordered: bool = False
    key: str = "extra_info.index"

    @property
    def identical(self) -> bool:
        return self.same_bytes

    def summary(self) -> str:
        if self.same_bytes:
            return f"{self.b}: identical to {self.a}"
        out = [f"{self.b} differs from {self.a}: rows {self.rows_a} -> {self.rows_b}"]
        out += [f"  schema: {c}" for c in self.schema_changes]
        for what, keys in (("added", self.added), ("removed", self.removed), ("changed", self.changed)):
            if keys:
                out.append(
                    f"  {len(keys)} row(s) {what} ({self.key}: {', '.join(map(str, keys[:EXAMPLES]))}"
                    f"{', ...' if len(keys) > EXAMPLES else ''})"
                )
        if self.reordered:
            out.append("  rows reordered (same rows, another order): the dataloader offset would point at other samples")
        if len(out) == 1 + len(self.schema_changes):
            out.append("  bytes differ (same rows and schema: metadata or encoding changed)")
        return "\n".join(out)


def _rows(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    return table.schema.names, table.to_pylist()


def _key(row: dict[str, Any], i: int, use_index: bool) -> Any:
    return row["extra_info"]["index"] if use_index else i


def _digest(row: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()


def diff(a: str | Path, b: str | Path) -> DataDiff:
    fa, fb = fingerprint(a), fingerprint(b)
    d = DataDiff(str(a), str(b), fa.sha256 == fb.sha256, fa.rows, fb.rows)
    if d.same_bytes:
        return d
    if fa.schema != fb.schema:
        la, lb = set(fa.schema.splitlines()), set(fb.schema.splitlines())
        d.schema_changes = [f"- {x.strip()}" for x in sorted(la - lb)] + [f"+ {x.strip()}" for x in sorted(lb - la)]
    _cols_a, rows_a = _rows(Path(a))
    _cols_b, rows_b = _rows(Path(b))
    use_index = all(isinstance(r.get("extra_info"), dict) and "index" in r["extra_info"] for r in rows_a + rows_b)
    keys_a = [_key(r, i, use_index) for i, r in enumerate(rows_a)]
    keys_b = [_key(r, i, use_index) for i, r in enumerate(rows_b)]
    if use_index and (len(set(keys_a)) != len(keys_a) or len(set(keys_b)) != len(keys_b)):
        use_index = False  # duplicated indices: match by position and content instead
    if not use_index:
        d.key = "row"
        dig_a, dig_b = [_digest(r) for r in rows_a], [_digest(r) for r in rows_b]
        if sorted(dig_a) == sorted(dig_b):
            d.reordered = dig_a != dig_b
            return d
        common = min(len(dig_a), len(dig_b))
        d.changed = [i for i in range(common) if dig_a[i] != dig_b[i]]
        d.added = list(range(common, len(dig_b)))
        d.removed = list(range(common, len(dig_a)))
        return d
    by_a = {k: _digest(r) for k, r in zip(keys_a, rows_a, strict=False)}
    by_b = {k: _digest(r) for k, r in zip(keys_b, rows_b, strict=False)}
    d.added = [k for k in keys_b if k not in by_a]
    d.removed = [k for k in keys_a if k not in by_b]
    d.changed = [k for k in keys_a if k in by_b and by_a[k] != by_b[k]]
    shared_a = [k for k in keys_a if k in by_b]
    shared_b = [k for k in keys_b if k in by_a]
    d.reordered = shared_a != shared_b
    return d
