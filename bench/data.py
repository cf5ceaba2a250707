"""Data benchmark, in the same run on the same (page-cached) files:

- fingerprint throughput (sha256 of the bytes streamed, row count, schema) on a parquet of at least
  1 GB, as a ratio of hashlib.file_digest(sha256) over the same file (target: 0.9x or better);
- the great-expectations suite (Relay's verl RL suite, flattening included) on 1M rows, against
  reading the same file with pyarrow.

Run with ./scripts/bench.sh data
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins"))

from relay.data.fingerprint import fingerprint  # noqa: E402
from relay.data.quality import check  # noqa: E402


def make(path: Path, rows: int, prompt_bytes: int) -> Path:
    """Rows in verl's RL schema; prompts of random hex so the parquet stays about as large as its data."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = None
    batch = 100_000
    for start in range(0, rows, batch):
        n = min(batch, rows - start)
        table = pa.table(
            {
                "data_source": ["bench"] * n,
                "prompt": [[{"role": "user", "content": os.urandom(prompt_bytes // 2).hex()}] for _ in range(n)],
                "ability": ["math"] * n,
                "reward_model": [{"style": "rule", "ground_truth": str(i % 97)} for i in range(start, start + n)],
                "extra_info": [{"split": "train", "index": i} for i in range(start, start + n)],
            }
        )
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return path


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(ROOT / ".relay" / "bench" / "data"))
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    work = Path(args.work)

    big = make(work / "big.parquet", 1_100_000, 1000)
    size = big.stat().st_size
    print(f"fingerprint file: {size / 1e9:.2f} GB, {big}")
    with open(big, "rb") as f:
        hashlib.file_digest(f, "sha256")  # warm the page cache

    def sha():
        with open(big, "rb") as f:
            hashlib.file_digest(f, "sha256")

    t_sha = timed(sha, args.rounds)
    t_fp = timed(lambda: fingerprint(big), args.rounds)
    print(
        f"fingerprint: {size / t_fp / 1e9:.2f} GB/s (median {t_fp:.2f}s); hashlib.file_digest sha256: "
        f"{size / t_sha / 1e9:.2f} GB/s (median {t_sha:.2f}s)"
    )
    print(f"RATIO fingerprint / hashlib.sha256 throughput: {t_sha / t_fp:.2f}x  (target >= 0.9x)")

    rows = make(work / "rows_1m.parquet", 1_000_000, 64)
    import pyarrow.parquet as pq

    t_read = timed(lambda: pq.read_table(rows), args.rounds)
    check(rows, min_rows=16)  # import great-expectations once, outside the timing
    t_ge = timed(lambda: check(rows, min_rows=16), args.rounds)
    print(f"great-expectations suite on 1M rows: {t_ge:.2f}s (median); pyarrow read of the same file: {t_read:.2f}s")
    print(f"RATIO GE suite time / pyarrow read time: {t_ge / t_read:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
