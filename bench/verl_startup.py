"""What a verl chunk costs before its first step, on the CPU path (include/runs/verl_tiny_cpu.yaml).

Runs the spec's three chunks (steps 0-2, 2-4, 4-6) with `relay train`, each one Ray job on the head at
the given address, and splits each job's wall time by the phase marks the job records in events.jsonl
(relay.runs.phases):

  job start -> resume checked     the job's interpreter and Relay's imports, the lease, the resume point
                                   found and validated at every level (Relay)
  -> trainer built                verl's config, run_ppo, the TaskRunner actor, TransferQueue (verl)
  -> dataloader ready             verl's datasets read and tokenized
  -> workers ready                worker groups placed, actor and reference models built, reward and
                                   rollout workers started
  -> checkpoint loaded            verl's load of the resume checkpoint (model, optimizer, data.pt)
  -> weights synced               the rollout given the actor's weights
  -> first step begins            validation before training (chunk 1 only)
  steps                           the chunk's steps, its checkpoint saved and committed
  job end                         the last step -> the job's end (verl's shutdown, Ray's teardown)

The baseline is the same job's own steps: start-up ÷ steps says how much of a chunk is not training.
On a GPU the steps are minutes each and the start-up adds vLLM's and the model's load; this is the
part of the start-up that Relay and verl's own orchestration decide.

Run with ./scripts/bench.sh overhead (after the demo DAG's boundary, on the stack's head), or alone:
  .venv/bin/python bench/verl_startup.py [RAY_DASHBOARD_ADDRESS]   (default: the stack's head, else a private one)
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins"))

from relay.jobs.ray_jobs import RayJobs  # noqa: E402
from relay.runs.metrics import read_events, read_jsonl  # noqa: E402
from relay.runs.phases import STARTUP, phase_marks  # noqa: E402

SPEC = ROOT / "include" / "runs" / "verl_tiny_cpu.yaml"
PARTS = ("job start -> " + STARTUP[0], *(f"-> {p}" for p in STARTUP[1:]), "steps", "job end")


def ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def relay_train(spec: Path, to_step: int, run_dir: Path, address: str) -> str:
    """`relay train SPEC --to-step N` into run_dir on the Ray head at address, as a user runs it; its output."""
    argv = [sys.executable, "-m", "relay", "train", str(spec), "--to-step", str(to_step)]
    argv += ["--checkpoint-dir", str(run_dir), "--offline", "--ray-address", address]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"relay train {spec.name} --to-step {to_step} failed:\n{(r.stdout + r.stderr)[-4000:]}")
    return r.stdout + r.stderr


def run_chunks(address: str, run_dir: Path, ends=(2, 4, 6)) -> None:
    for end in ends:
        relay_train(SPEC, end, run_dir, address)


def measure(address: str, run_dir: Path) -> list[dict]:
    events = read_events(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    jobs = RayJobs(address)
    out = []
    for start in (e for e in events if e["event"] == "chunk_start"):
        attempt = start["attempt"]
        info = jobs.client.get_job_info(attempt)
        marks = [ts(t) for t in phase_marks(events, attempt).values()]
        steps = [r for r in rows if r.get("attempt") == attempt]
        if len(marks) != len(STARTUP) or not steps:
            raise SystemExit(f"job {attempt} recorded {len(marks)} of the {len(STARTUP)} start-up marks")
        times = [info.start_time / 1e3, *marks]
        last_step_done = max(r["time"] for r in steps)
        out.append(
            {
                "chunk": start.get("chunk"),
                "resumed_from": start.get("resumed_from"),
                "steps_n": len(steps),
                **{p: b - a for p, a, b in zip(PARTS, times, times[1:], strict=False)},
                "steps": last_step_done - times[-1],
                "job end": info.end_time / 1e3 - last_step_done,
                "start-up": times[-1] - times[0],
                "wall": info.end_time / 1e3 - times[0],
            }
        )
    return out


def report(chunks: list[dict]) -> dict:
    width = max(len(p) for p in PARTS)
    print(f"\nverl chunk start-up on the CPU path ({SPEC.name}: tiny Qwen2, FSDP2, hf rollout; one Ray job per chunk)")
    print(f"{'':<{width}} " + " ".join(f"{'chunk ' + str(c['chunk']):>10}" for c in chunks) + f" {'median':>10}")
    for p in (*PARTS, "start-up", "wall"):
        values = [c[p] for c in chunks]
        print(f"{p:<{width}} " + " ".join(f"{v:>9.1f}s" for v in values) + f" {statistics.median(values):>9.1f}s")
    med = {p: statistics.median(c[p] for c in chunks) for p in (*PARTS, "start-up", "wall")}
    relay_part = med[PARTS[0]]
    print(
        f"\nmedian start-up {med['start-up']:.1f}s against the same job's {chunks[0]['steps_n']} steps "
        f"{med['steps']:.1f}s (baseline): {med['start-up'] / med['steps']:.1f}x the training it precedes; "
        f"{(med['wall'] - med['steps']) / med['wall']:.0%} of a chunk is not training. Of the start-up, "
        f"job start -> resume checked (the job's imports, Relay's lease and resume validation) is "
        f"{relay_part:.1f}s ({relay_part / med['start-up']:.0%}); the rest is verl's."
    )
    return med


def main(address: str | None = None) -> int:
    """On the head at `address`; else the local stack's, if it runs; else a private head of this process's own."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from relay.devstack import stack

    if address is None and stack.ray_running():
        address = stack.ray_address()
    head = nullcontext(SimpleNamespace(address=address)) if address else stack.private_ray_head(say=print)
    with head as h, tempfile.TemporaryDirectory(prefix="relay-bench-verl-") as tmp:
        run_dir = Path(tmp) / "run"
        run_chunks(h.address, run_dir)
        report(measure(h.address, run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
