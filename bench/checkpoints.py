"""Checkpoint benchmark: validation against hashlib sha256, publication against the aws CLI.

On a verl checkpoint of at least 2 GB (FSDP2, world size 2, written by verl's FSDPCheckpointManager),
in the same run, on the same (page-cached) bytes and the same S3 server:

- validation throughput (structure, consistency, integrity, loadability, numerics) as a ratio of
  hashlib.sha256 over the same files (target: 0.8x or better);
- publication throughput (CheckpointStore.publish: multipart, CRC64NVME, verify, manifest, latest)
  as a ratio of `aws s3 cp --recursive` of the same folder (target: 1.0x or better).

Run with ./scripts/bench.sh checkpoints (it starts the S3 server and installs the aws CLI in its
own venv, .venv-bench: awscli pins another botocore than boto3's).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT / "tests" / "support")]

from relay.checkpoints import manifest  # noqa: E402
from relay.checkpoints.validate import validate_checkpoint, write_manifest  # noqa: E402
from relay.devstack import stack  # noqa: E402
from relay.runs import layout  # noqa: E402
from relay.s3.store import CheckpointStore, s3_client  # noqa: E402


def build(run: Path, hidden: int, layers: int, vocab: int) -> Path:
    import verl_checkpoint

    step_dir = layout.step_dir(run, 1)
    if not (step_dir / "data.pt").exists():
        print(f"writing a verl checkpoint (hidden {hidden}, {layers} layers, vocab {vocab}, FSDP2, world size 2)...",
              flush=True)
        verl_checkpoint.make(run, world_size=2, fsdp=2, hidden=hidden, layers=layers, vocab=vocab)
    return step_dir


def files_of(step_dir: Path) -> list[Path]:
    return [step_dir / rel for rel in manifest.checkpoint_files(step_dir)]


def sha256_all(files: list[Path]) -> float:
    t = time.perf_counter()
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while block := fh.read(8 << 20):
                h.update(block)
    return time.perf_counter() - t


def validate_once(run: Path) -> float:
    m = layout.step_dir(run, 1) / manifest.NAME
    m.unlink(missing_ok=True)  # validate from scratch each time, as the gate does on a new checkpoint
    t = time.perf_counter()
    report = validate_checkpoint(run, 1)
    dt = time.perf_counter() - t
    assert report.ok, report.summary()
    return dt


def aws_cp(awscli: Path, step_dir: Path, uri: str) -> float:
    env = {**os.environ, **stack.s3_env()}
    t = time.perf_counter()
    subprocess.run([str(awscli), "s3", "cp", "--recursive", "--only-show-errors", str(step_dir), uri], check=True,
                   env=env)
    return time.perf_counter() - t


def relay_publish(run: Path, uri: str) -> float:
    store = CheckpointStore(s3_client(), uri)
    t = time.perf_counter()
    result = store.publish("bench", run, 1)
    dt = time.perf_counter() - t
    assert not result.skipped
    return dt


def delete_prefix(uri: str) -> None:
    """Remove what a round uploaded: the S3 server's disk is the machine's disk."""
    store = CheckpointStore(s3_client(), uri)
    keys, token = [], None
    while True:
        r = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.prefix + "/",
                                         **({"ContinuationToken": token} if token else {}))
        keys += [o["Key"] for o in r.get("Contents", [])]
        if not r.get("IsTruncated"):
            break
        token = r["NextContinuationToken"]
    for i in range(0, len(keys), 1000):
        store.client.delete_objects(Bucket=store.bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})


def checkpoint_options(doc: str | None) -> argparse.ArgumentParser:
    """The options of a benchmark on the shared >= 2 GB checkpoint (this one's and bench/reshard.py's)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(ROOT / ".relay" / "bench"), help="where the checkpoint is written")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=3)
    return p


def prepared(args) -> tuple[Path, Path, list[Path], int]:
    """(run, step folder, files, bytes) of the benchmark checkpoint, written first if it is missing."""
    run = Path(args.work) / "run"
    step_dir = build(run, args.hidden, args.layers, args.vocab)
    layout.write_tracker(run, 1)
    files = files_of(step_dir)
    total = sum(f.stat().st_size for f in files)
    print(f"checkpoint: {len(files)} files, {total / 1e9:.2f} GB at {step_dir}")
    if total < 2e9:
        print("warning: under 2 GB; raise --hidden/--layers", file=sys.stderr)
    return run, step_dir, files, total


def main() -> int:
    p = checkpoint_options(__doc__)
    p.add_argument("--awscli", default=str(ROOT / ".venv-bench" / "bin" / "aws"))
    args = p.parse_args()

    os.environ.update(stack.s3_env())
    run, step_dir, files, total = prepared(args)
    sha256_all(files)  # warm the page cache: both sides read cached bytes

    sha, val = [], []
    for _ in range(args.rounds):
        sha.append(sha256_all(files))
        val.append(validate_once(run))
    sha_t, val_t = statistics.median(sha), statistics.median(val)
    print(f"validation: {total / val_t / 1e9:.2f} GB/s (median {val_t:.2f}s); hashlib sha256: "
          f"{total / sha_t / 1e9:.2f} GB/s (median {sha_t:.2f}s)")
    print(f"RATIO validation / hashlib.sha256 throughput: {sha_t / val_t:.2f}x  (target >= 0.8x)")

    report = validate_checkpoint(run, 1)
    write_manifest(report, "bench")
    stack.s3_start()
    aws, rel = [], []
    for i in range(args.rounds):
        tag = uuid.uuid4().hex[:8]
        aws.append(aws_cp(Path(args.awscli), step_dir, f"s3://relay/bench-aws-{tag}/bench/global_step_1/"))
        rel.append(relay_publish(run, f"s3://relay/bench-relay-{tag}"))
        delete_prefix(f"s3://relay/bench-aws-{tag}")
        delete_prefix(f"s3://relay/bench-relay-{tag}")
    aws_t, rel_t = statistics.median(aws), statistics.median(rel)
    print(f"publish: relay {total / rel_t / 1e6:.0f} MB/s (median {rel_t:.2f}s); aws s3 cp --recursive "
          f"{total / aws_t / 1e6:.0f} MB/s (median {aws_t:.2f}s)")
    print(f"RATIO publish / aws-cli throughput: {aws_t / rel_t:.2f}x  (target >= 1.0x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
