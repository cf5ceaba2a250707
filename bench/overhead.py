"""Wall-time overhead at chunk boundaries: what Airflow and Ray add around the trainer's own steps.

Runs the demo spec's DAG (60 steps, 3 chunks) on the local stack (started here unless one runs),
as the demo does but without the provoked resume, then splits each chunk's wall time, from the REST
API's task instances, the Ray jobs' own start and end times, and the run's metrics:

  scheduling gap     the upstream task ended -> the chunk's train task runs (scheduler, executor, process)
  submission         train task runs -> its Ray job starts (settings and sources re-checked, submit,
                     runtime_env upload)
  trainer start-up   Ray job starts -> the first step begins (runtime env, interpreter, imports of
                     torch and verl, lease, resume validation, model build, checkpoint load)
  training           the steps, and the checkpoint saved at the chunk's end
  job end -> done    the job ended -> the train task is done (trigger polling, the deferred task
                     scheduled again, execute_complete)
  validation         the gate's checks of the chunk's checkpoint, before the next chunk may start

The baseline is the chunk's own wall time in the same run (train task queued... to validate done).
The projection keeps Airflow's and Ray's parts in seconds and puts them beside a 1-hour GPU chunk:
the trainer's start-up there is the GPU job's own (model load, rollout-engine warm-up), not Relay's.

Then bench/verl_startup.py splits a verl chunk's start-up on the CPU path (verl_tiny_cpu.yaml) on the same
Ray head.

Run with ./scripts/bench.sh overhead
"""

from __future__ import annotations

import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins"))

import verl_startup  # noqa: E402

from relay.devstack import stack  # noqa: E402
from relay.devstack.airflow_api import AirflowAPI  # noqa: E402
from relay.jobs.ray_jobs import RayJobs  # noqa: E402
from relay.runs.metrics import read_events, read_jsonl  # noqa: E402
from relay.runs.spec import load_spec  # noqa: E402

PARTS = ("scheduling gap", "submission", "trainer start-up", "training", "job end -> done", "validation")
AIRFLOW_RAY = ("scheduling gap", "submission", "job end -> done")  # what Relay's orchestration adds


def ts(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def measure(api: AirflowAPI, spec, run_id: str, run_dir: Path) -> list[dict]:
    tis = {t["task_id"]: t for t in api.task_instances(spec.dag_id, run_id)}
    rows = read_jsonl(run_dir / "metrics.jsonl")
    starts = {e["chunk"]: e for e in read_events(run_dir) if e["event"] == "chunk_start"}
    jobs = RayJobs(stack.ray_address())
    out = []
    for k in sorted(starts):
        train, validate = tis[f"chunk_{k:02d}.train"], tis[f"chunk_{k:02d}.validate"]
        upstream = tis["preflight.data"] if k == 1 else tis[f"chunk_{k - 1:02d}.validate"]
        job = jobs.client.get_job_info(starts[k]["attempt"])
        job_start, job_end = job.start_time / 1e3, job.end_time / 1e3
        steps = [r for r in rows if r.get("chunk") == k]
        first_step_begins = steps[0]["time"] - steps[0]["seconds"]
        out.append({
            "chunk": k,
            "scheduling gap": ts(train["start_date"]) - ts(upstream["end_date"]),
            "submission": job_start - ts(train["start_date"]),
            "trainer start-up": first_step_begins - job_start,
            "training": job_end - first_step_begins,
            "job end -> done": ts(train["end_date"]) - job_end,
            "validation": ts(validate["end_date"]) - ts(train["end_date"]),
            "wall": ts(validate["end_date"]) - ts(upstream["end_date"]),
            "steps": len(steps),
        })
    return out


def report(chunks: list[dict]) -> None:
    print(f"{'chunk':>5} " + " ".join(f"{p:>17}" for p in PARTS) + f" {'chunk wall':>11}")
    for c in chunks:
        print(f"{c['chunk']:>5} " + " ".join(f"{c[p]:>16.2f}s" for p in PARTS) + f" {c['wall']:>10.2f}s")
    med = {p: statistics.median(c[p] for c in chunks) for p in (*PARTS, "wall")}
    print(f"{'med':>5} " + " ".join(f"{med[p]:>16.2f}s" for p in PARTS) + f" {med['wall']:>10.2f}s")
    orchestration = sum(med[p] for p in AIRFLOW_RAY)
    boundary = med["wall"] - med["training"]
    print(f"\nper chunk boundary (medians): Airflow + Ray add {orchestration:.1f}s "
          f"({', '.join(f'{p} {med[p]:.1f}s' for p in AIRFLOW_RAY)}); the trainer's start-up "
          f"{med['trainer start-up']:.1f}s and validation {med['validation']:.1f}s come on top")
    print(f"ratio to the demo chunk's wall time ({med['wall']:.1f}s, baseline): Airflow + Ray "
          f"{orchestration / med['wall']:.1%}; everything but the steps {boundary / med['wall']:.1%}")
    for minutes in (60,):
        print(f"projected for {minutes}-minute GPU chunks: Airflow + Ray {orchestration:.1f}s = "
              f"{orchestration / (minutes * 60):.2%} of the chunk (goal < 1%); with this CPU trainer's start-up and "
              f"validation too: {(orchestration + med['trainer start-up'] + med['validation']) / (minutes * 60):.2%}")


def main() -> int:
    spec = load_spec(ROOT / "include" / "runs" / "demo.yaml")
    started = not stack._http_ok(f"{stack.airflow_url()}/api/v2/monitor/health")
    info = stack.up(with_airflow=True) if started else None
    try:
        home = Path(info["airflow_home"]) if info else stack.state_dir() / "airflow"
        api = AirflowAPI(stack.airflow_url(), "admin", stack.airflow_password(home))
        api.wait_for_dag(spec.dag_id)
        run = f"bench-overhead-{time.strftime('%Y%m%d-%H%M%S')}"
        run_id = api.trigger(spec.dag_id, {"run": run, "alert_channels": []})["dag_run_id"]
        print(f"triggered {spec.dag_id} run {run} ({spec.total_steps} steps in chunks of {spec.chunk_steps}); waiting")
        state = api.wait_for_run(spec.dag_id, run_id, timeout=1800)["state"]
        if state != "success":
            print(f"the DAG run ended {state}; see the Airflow UI", file=sys.stderr)
            return 1
        report(measure(api, spec, run_id, spec.run_dir(run)))
        # verl's own chunk on the CPU path, on the same head: what its start-up costs (bench/verl_startup.py)
        return verl_startup.main(stack.ray_address())
    finally:
        if started:
            stack.down()


if __name__ == "__main__":
    sys.exit(main())
