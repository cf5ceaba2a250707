"""Reshard benchmark: `relay checkpoint reshard` against copying the same files.

On a verl checkpoint of at least 2 GB (FSDP2, world size 2, written by verl's FSDPCheckpointManager; the same
one as ./scripts/bench.sh checkpoints), in the same run, on page-cached bytes:

- reshard throughput, world size 2 -> 4 (relay.checkpoints.reshard, --out: every model and optimizer tensor
  re-cut, every file fsynced), as a ratio of shutil.copytree of the same step folder with an fsync of each
  file (target: 0.5x or better);
- the reshard's peak anonymous memory (RssAnon, sampled every 20 ms: its memory-mapped input and file-backed
  output pages are not counted, as they inflate RSS), against the checkpoint's largest tensor.

Run with ./scripts/bench.sh reshard.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT / "tests" / "support"), str(ROOT / "bench")]

from checkpoints import checkpoint_options, in_child, prepared  # noqa: E402

from relay.common import files  # noqa: E402
from relay.runs import layout  # noqa: E402


def reshard_once(run: Path, out: Path, world_size: int) -> tuple[float, int]:
    """(seconds, peak RssAnon in bytes above the child's once set up) of one reshard in a child process."""
    return in_child(
        "from relay.checkpoints.reshard import reshard\n"
        "import torch.distributed, torch.testing._internal.distributed.fake_pg",
        f"reshard(Path({str(run)!r}), {world_size}, out=Path({str(out)!r}))",
    )


def copy_once(step_dir: Path, dest: Path) -> float:
    """shutil.copytree of the step folder, each file fsynced as the reshard fsyncs its own."""
    t = time.perf_counter()
    shutil.copytree(step_dir, dest)
    files.fsync_tree(dest)  # what the reshard calls on its output
    return time.perf_counter() - t


def largest_tensor_bytes(step_dir: Path) -> int:
    from relay.checkpoints.safeload import load

    sd = load(step_dir / "actor" / layout.shard_name("model", 2, 0))
    return max(v.numel() * v.element_size() for v in sd.values())  # global sizes (DTensor)


def main() -> int:
    p = checkpoint_options(__doc__)
    p.add_argument("--to", type=int, default=4, help="the world size to reshard to (from 2)")
    args = p.parse_args()

    run, step_dir, _, total = prepared(args)
    print(f"resharding it from world size 2 to {args.to}")
    copy_t, reshard_t, peaks = [], [], []
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        copy_once(step_dir, Path(tmp) / "warm")  # both sides read page-cached bytes
        shutil.rmtree(Path(tmp) / "warm")
        for i in range(args.rounds):
            copy_t.append(copy_once(step_dir, Path(tmp) / f"copy{i}"))
            shutil.rmtree(Path(tmp) / f"copy{i}")
            seconds, peak = reshard_once(run, Path(tmp) / f"out{i}", args.to)
            reshard_t.append(seconds)
            peaks.append(peak)
            shutil.rmtree(Path(tmp) / f"out{i}")
    c, r = statistics.median(copy_t), statistics.median(reshard_t)
    largest = largest_tensor_bytes(step_dir)
    print(
        f"reshard: {total / r / 1e6:.0f} MB/s (median {r:.2f}s); copytree + fsync: {total / c / 1e6:.0f} MB/s "
        f"(median {c:.2f}s)"
    )
    print(f"RATIO reshard / copytree+fsync throughput: {c / r:.2f}x  (target >= 0.5x)")
    print(
        f"peak anonymous memory of the reshard: {max(peaks) / 2**20:.0f} MiB above its interpreter's "
        f"(the checkpoint: {total / 2**20:.0f} MiB; its largest tensor: {largest / 2**20:.0f} MiB)"
    )
    print(
        json.dumps(
            {
                "bytes": total,
                "reshard_s": reshard_t,
                "copy_s": copy_t,
                "peak_anon_bytes": peaks,
                "largest_tensor_bytes": largest,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
