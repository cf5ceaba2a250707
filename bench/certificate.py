"""What a checkpoint certificate costs (relay.checkpoints.certificate), on Relay's CPU trainer.

1. At a save: the certificate (probe forward, parameter digests, state digests) against the rest of the save
   as the trainer's session pays it (verl's FSDPCheckpointManager writing the shards, data.pt, the fsync of the
   staged folder), the median of REPEATS saves of the same state. Two models: the demo spec's, and the same
   trainer at hidden size 1024 and 8 layers (about 100M parameters), where a save writes about 1.2 GB.
2. At a resume: the certificate's check (recompute and compare) against the chunk's start-up as a user pays it:
   a `python -m relay train` process resuming the demo spec, from the process's start to its first step
   (chunk_start's `process_started` to its `time`, which includes the check).

Run with ./scripts/bench.sh certificate
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins"))

import yaml  # noqa: E402

from relay.common import files  # noqa: E402
from relay.runs.metrics import read_events  # noqa: E402
from relay.spec.run_spec import load_spec  # noqa: E402

REPEATS = 5
SPEC = ROOT / "include" / "runs" / "demo.yaml"


def save_costs(spec, workdir: Path) -> tuple[float, float]:
    """(median certificate seconds, median save seconds without it) over REPEATS saves of one trained state."""
    from relay.trainers.session import pin_threads
    from relay.trainers.tiny_grpo.trainer import _TinyGRPO

    pin_threads(spec.threads)
    trainer = _TinyGRPO(spec, [str(ROOT / f) for f in spec.data.train_files])
    trainer.train_step(next(iter(trainer.batches())), 1)
    certs, saves = [], []
    for i in range(REPEATS):
        folder = workdir / f"save{i}"
        t0 = time.perf_counter()
        trainer.save(folder, 1)  # verl's shards, data.pt, the certificate
        files.fsync_tree(folder)
        total = time.perf_counter() - t0
        t1 = time.perf_counter()
        trainer.certificate(1)
        cert = time.perf_counter() - t1
        certs.append(cert)
        saves.append(total - cert)
    trainer.close()
    return statistics.median(certs), statistics.median(saves)


def spec_file(workdir: Path, **model) -> Path:
    """The demo spec without S3, its runs under workdir, the model's sizes overridden by `model`."""
    d = yaml.safe_load(SPEC.read_text())
    d.pop("s3", None)
    d["checkpoint_dir"] = str(workdir / "runs")
    d["trainer"]["settings"]["model"].update(model)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "demo.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def resume_costs(workdir: Path) -> tuple[float, float]:
    """(certificate check seconds, start-up seconds) of a `relay train` process resuming the demo spec at step 2."""
    spec = spec_file(workdir)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "plugins")}
    for to in (2, 4):
        subprocess.run(
            [sys.executable, "-m", "relay", "train", str(spec), "--to-step", str(to)],
            cwd=ROOT,
            env=env,
            check=True,
            capture_output=True,
        )
    start = [e for e in read_events(workdir / "runs" / "demo") if e["event"] == "chunk_start"][-1]
    assert start["certificate"] == "certified", start
    began = float(start["process_started"])  # epoch seconds; `time` is the event's ISO timestamp
    return float(start["certificate_seconds"]), datetime.fromisoformat(start["time"]).timestamp() - began


BIG = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("demo model", {}), ("demo trainer at hidden 1024, 8 layers", BIG)):
            work = Path(tmp) / name.replace(" ", "_").replace(",", "")
            cert, save = save_costs(load_spec(spec_file(work, **model)), work)
            print(f"save, {name}: certificate {cert * 1e3:.1f} ms, the rest of the save {save * 1e3:.1f} ms")
            print(f"RATIO certificate / save without it ({name}): {cert / save:.4f}x  (target <= 0.01x)")
        check, startup = resume_costs(Path(tmp) / "resume")
        print(f"resume, demo spec: certificate check {check * 1e3:.1f} ms, chunk start-up {startup:.2f} s")
        print(f"RATIO certificate check / chunk start-up (demo spec): {check / startup:.4f}x  (target <= 0.01x)")


if __name__ == "__main__":
    main()
