"""What a resume's exactness costs verl's separate_async trainer: Relay's `lossless` and `bitwise` against verl's own
loop, on the CPU stand-in that behaves like an engine in time.

include/runs/verl_tiny_cpu_lossless.yaml: separate_async (training on one logical GPU, the hf rollout on its own),
one batch ahead, max_staleness 2 with verl's `wait`, the hf engine streaming a token each 200 ms with long-tail
lengths up to 32 tokens. Three runs of its 8 steps on one private Ray head, one Ray job each:

  lossless   `relay train SPEC --to-step 8` (Relay's chunk trainer, resume_exactness lossless)
  bitwise    the same with resume_exactness bitwise (generation drained before each sample and weight change)
  verl       verl's own main_ppo on the config Relay composes, Relay's hooks and saves off (bench/async_verl_loop.py)

From each job's console (verl's own metrics line, the same in all three): the step time less its save
(timing_s/step - timing_s/save_checkpoint), the mean of steps 2-8 (step 1 waits for the warm-up batch in all; a step
that waited for the tail is often followed by one whose batch is ready, so the mean is the throughput), and
the time the steps waited for samples (timing_s/gen). From the stand-in's record of each request
(RELAY_HF_ENGINE_TRACE): the time the engine was busy generating, and the requests an abort cut short. The share
of generation overlapped with training is at least 1 - waited / busy (a wait with the engine idle, verl's 2 s
poll of its queue, counts as not overlapped).

Prints `RATIO lossless step time / verl's own step time: N.NNx` (target <= 1.05x) and the bitwise one beside it.

Run with ./scripts/bench.sh async
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins"))

import verl_startup  # noqa: E402

from relay.devstack import stack  # noqa: E402
from relay.jobs.ray_jobs import shipped_code  # noqa: E402
from relay.trainers.verl_ppo.cpu.hf_rollout import TRACE_ENV  # noqa: E402
from relay.trainers.verl_ppo.verl_contract import CPU_PLATFORM_ENV  # noqa: E402

SPEC = ROOT / "include" / "runs" / "verl_tiny_cpu_lossless.yaml"
STEPS = 8
TIMING = re.compile(r"\bstep:(\d+) - .*")


def variant(work: Path, name: str, settings: dict) -> Path:
    d = yaml.safe_load(SPEC.read_text())
    d["trainer"]["settings"].update(settings)
    d["checkpoint_dir"] = str(work / name)
    d["data"]["train_files"] = [str(ROOT / f) for f in d["data"]["train_files"]]
    d["data"]["val_files"] = [str(ROOT / f) for f in d["data"]["val_files"]]
    d.setdefault("ray", {}).setdefault("env_vars", {})[TRACE_ENV] = str(work / f"{name}.trace")
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def verls_own(spec: Path, work: Path, address: str) -> str:
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address)
    env = {
        **CPU_PLATFORM_ENV,
        "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1",
        "OMP_NUM_THREADS": "2",
        "PYTHONUNBUFFERED": "1",
        TRACE_ENV: str(work / "verl.trace"),
    }
    job = client.submit_job(
        entrypoint=f"python async_verl_loop.py {spec} {work / 'verl' / 'run'} {STEPS}",
        runtime_env={**shipped_code(), "working_dir": str(ROOT / "bench"), "env_vars": env},
    )
    while (status := client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        time.sleep(2)
    text = client.get_job_logs(job)
    (work / "verl.log").write_text(text)
    if status != JobStatus.SUCCEEDED:
        raise SystemExit(f"verl's own loop {status}:\n{text[-4000:]}")
    return text


def steps_of(log: str) -> dict[int, dict[str, float]]:
    """verl's metrics line of each step (the last one printed, should a step repeat): its timing_s values."""
    out = {}
    for m in TIMING.finditer(log):
        fields = dict(re.findall(r"(timing_s/[a-z_]+):([0-9.]+)", m.group(0)))
        out[int(m.group(1))] = {k.removeprefix("timing_s/"): float(v) for k, v in fields.items()}
    return out


def busy(trace: Path) -> tuple[float, int, int]:
    """The engine's busy time (the union of its requests' spans), its requests and those an abort cut short."""
    spans = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    total, end = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s["began"]):
        begin = max(s["began"], end)
        if s["ended"] > begin:
            total += s["ended"] - begin
        end = max(end, s["ended"])
    return total, len(spans), sum(1 for s in spans if s["cut"])


def measure(name: str, log: str, trace: Path) -> dict:
    steps = steps_of(log)
    missing = [s for s in range(1, STEPS + 1) if s not in steps]
    if missing:
        raise SystemExit(f"{name}: no metrics line for step(s) {missing}")
    per_step = [steps[s]["step"] - steps[s].get("save_checkpoint", 0.0) for s in range(2, STEPS + 1)]
    waited = sum(steps[s].get("gen", 0.0) for s in range(1, STEPS + 1))
    generating, requests, cut = busy(trace)
    return {
        "name": name,
        "step": statistics.fmean(per_step),
        "waited": waited,
        "busy": generating,
        "overlap": max(0.0, 1 - waited / generating) if generating else 0.0,
        "requests": requests,
        "cut": cut,
    }


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="relay-bench-async-"))
    results = {}
    try:
        with stack.private_ray_head(num_cpus=16, num_gpus=2) as head:
            for name, settings in (("lossless", {}), ("bitwise", {"resume_exactness": "bitwise"})):
                spec = variant(work, name, settings)
                log = verl_startup.relay_train(spec, STEPS, work / name / "run", head.address)
                (work / f"{name}.log").write_text(log)
                results[name] = measure(name, log, work / f"{name}.trace")
            spec = variant(work, "verl", {})
            results["verl"] = measure("verl", verls_own(spec, work, head.address), work / "verl.trace")
    finally:
        if not os.environ.get("RELAY_BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'run':<10} {'step s':>7} {'waited s':>9} {'engine busy s':>14} {'overlapped':>11} {'requests':>9} {'cut':>5}")
    for r in results.values():
        print(
            f"{r['name']:<10} {r['step']:>7.2f} {r['waited']:>9.1f} {r['busy']:>14.1f} {r['overlap']:>10.0%} "
            f"{r['requests']:>9} {r['cut']:>5}"
        )
    own = results["verl"]["step"]
    print(f"RATIO lossless step time / verl's own step time: {results['lossless']['step'] / own:.2f}x")
    print(f"RATIO bitwise step time / verl's own step time: {results['bitwise']['step'] / own:.2f}x")


if __name__ == "__main__":
    main()
