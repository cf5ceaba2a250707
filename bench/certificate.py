"""What a checkpoint certificate costs (relay.checkpoints.certificate): the training it blocks between two saves, and
the resume's check.

1. At a save: the certificate's blocking time (what the training thread waits for: with saves off the critical path
   (`checkpoints.async_save`) only the probe's forward, the digests being taken from the host copy on the save's
   thread; with synchronous saves all of it) against the training time between two saves at the spec's own save
   frequency. Three cases: the demo spec and the CPU trainer at hidden size 1024 and 8 layers (about 100M parameters),
   in-process, the median of REPEATS certificates of one trained state against the median step time times the steps
   between saves; and the verl CPU spec (include/runs/verl_tiny_cpu.yaml), a `relay train` job of 4 steps whose
   certificates (computed in verl's workers at each save, `probe_seconds`) and steps' times are read from the run.
2. At a resume: the certificate's check (recompute and compare) against the chunk's start-up as a user pays it:
   a `python -m relay train` process resuming the demo spec, from the process's start to its first step
   (chunk_start's `process_started` to its `time`, which includes the check).

Run with ./scripts/bench.sh certificate
"""

from __future__ import annotations

import json
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

from relay.runs import layout  # noqa: E402
from relay.runs.metrics import read_events  # noqa: E402
from relay.spec.run_spec import load_spec  # noqa: E402

REPEATS = 5
STEPS = 5  # training steps timed (after one to warm up)
SPEC = ROOT / "include" / "runs" / "demo.yaml"
VERL_SPEC = ROOT / "include" / "runs" / "verl_tiny_cpu.yaml"


def cpu_trainer_costs(spec, async_save: bool) -> tuple[float, float, int]:
    """(median certificate blocking seconds, median step seconds, steps between saves) of the CPU trainer."""
    from relay.trainers.session import pin_threads
    from relay.trainers.tiny_grpo.trainer import _TinyGRPO

    pin_threads(spec.threads)
    trainer = _TinyGRPO(spec, [str(ROOT / f) for f in spec.data.train_files])
    batches = trainer.batches()
    steps = []
    for step in range(1, STEPS + 2):
        t0 = time.perf_counter()
        trainer.train_step(next(batches), step)
        steps.append(time.perf_counter() - t0)
    blocking = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        # what the training thread waits for: off the critical path the digests come later, from the copy
        trainer.certificate(STEPS + 1, params={} if async_save else None, optimizer=({}, []) if async_save else None)
        blocking.append(time.perf_counter() - t0)
    trainer.close()
    every = spec.settings.save_freq or spec.chunk_steps
    return statistics.median(blocking), statistics.median(steps[1:]), every


def verl_costs(workdir: Path) -> tuple[float, float, int]:
    """(certificate seconds at the last save, training seconds between the last two saves, steps between them) of a
    `relay train` of the verl CPU spec to step 4 (saves at steps 2 and 4)."""
    d = yaml.safe_load(VERL_SPEC.read_text())
    d["checkpoint_dir"] = str(workdir / "runs")
    d["data"]["train_files"] = [str(ROOT / f) for f in d["data"]["train_files"]]
    d["data"]["val_files"] = [str(ROOT / f) for f in d["data"]["val_files"]]
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "verl.yaml"
    spec.write_text(yaml.safe_dump(d, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "plugins")}
    subprocess.run(
        [sys.executable, "-m", "relay", "train", str(spec), "--to-step", "4", "--offline"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    run = workdir / "runs" / d["name"]
    cert = json.loads((layout.step_dir(run, 4) / "relay_certificate.json").read_text())
    rows = {r["step"]: r for r in map(json.loads, (run / layout.METRICS).read_text().splitlines())}
    return float(cert["probe_seconds"]), rows[3]["seconds"] + rows[4]["seconds"], 2


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


def ratio(name: str, blocking: float, between: float, detail: str) -> None:
    print(f"{name}: certificate blocking {blocking * 1e3:.1f} ms, training between saves {between:.2f} s ({detail})")
    print(f"RATIO certificate blocking / training time between saves ({name}): {blocking / between:.4f}x  (target <= 0.01x)")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cases = (("demo spec", {}, None), ("CPU trainer at hidden 1024, 8 layers, async saves", BIG, True))
        for name, model, async_save in cases:
            work = Path(tmp) / name.replace(" ", "_").replace(",", "")
            spec = load_spec(spec_file(work, **model))
            async_save = spec.checkpoints.async_save if async_save is None else async_save
            blocking, step, every = cpu_trainer_costs(spec, async_save)
            detail = f"{every} steps of {step:.3f} s, {'async' if async_save else 'synchronous'} saves"
            ratio(name, blocking, every * step, detail)
        blocking, between, every = verl_costs(Path(tmp) / "verl")
        ratio("verl CPU spec", blocking, between, f"{every} steps, the certificate computed in verl's workers")
        check, startup = resume_costs(Path(tmp) / "resume")
        print(f"resume, demo spec: certificate check {check * 1e3:.1f} ms, chunk start-up {startup:.2f} s")
        print(f"RATIO certificate check / chunk start-up (demo spec): {check / startup:.4f}x  (target <= 0.01x)")


if __name__ == "__main__":
    main()
