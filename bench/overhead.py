"""Wall-time overhead at chunk boundaries: what Airflow and Ray add around the trainer's own steps.

Runs the demo spec's DAG (60 steps, 3 chunks) on the local stack (started here unless one runs), as the demo
does but without the provoked resume, then splits each chunk's wall time by the goodput ledger
(relay.insights.goodput): the same phase events in events.jsonl (relay.runs.phases: the train task's and the Ray
job's marks, the trainer's rows and saves, the gate's validation) that the run report and `relay report --json`
read, so the benchmark and the report cannot disagree. A chunk's parts:

  scheduling      Airflow before its train task runs (the previous chunk's validate task included)
  submission      train task runs -> its Ray job runs (Relay's checks, the submission, runtime_env)
  startup         Ray job runs -> the first step begins (interpreter, imports, lease, resume, model build)
  training, save  the steps, and the checkpoint saved and committed
  teardown        the last save -> the train task is done (the trainer's exit, Ray's job end, the trigger's
                  poll, the deferred task resumed)
  validation      the gate's checks of the chunk's checkpoint
  publication     the upload the run waited on (the last chunk's, before the DAG run's end)

The baseline is the chunk's own wall time in the same run (the sum of its parts). The projection keeps
Airflow's and Ray's parts in seconds and puts them beside a 1-hour GPU chunk: the trainer's start-up there is
the GPU job's own (model load, rollout-engine warm-up), not Relay's.

Then bench/verl_startup.py splits a verl chunk's start-up on the CPU path (verl_tiny_cpu.yaml) on the same
Ray head (RELAY_BENCH_NO_VERL=1 skips it).

Run with ./scripts/bench.sh overhead
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins"))

import verl_startup  # noqa: E402

from relay.devstack import stack  # noqa: E402
from relay.devstack.airflow_api import AirflowAPI  # noqa: E402
from relay.insights import goodput  # noqa: E402
from relay.spec.run_spec import load_spec  # noqa: E402

PARTS = ("scheduling", "submission", "startup", "training", "save", "teardown", "validation", "publication")
AIRFLOW_RAY = ("scheduling", "submission", "teardown")  # what Relay's orchestration adds


def measure(run_dir: Path) -> list[dict]:
    """Each chunk's parts, from the run's goodput ledger."""
    ledger = goodput.ledger(run_dir)
    if ledger is None:
        raise SystemExit(f"{run_dir}: no chunk attempt recorded")
    return [{"chunk": c["chunk"], **{p: c["parts"][p] for p in PARTS}, "wall": c["seconds"]} for c in ledger.chunks()]


def report(chunks: list[dict]) -> None:
    print(f"{'chunk':>5} " + " ".join(f"{p:>11}" for p in PARTS) + f" {'chunk wall':>11}")
    for c in chunks:
        print(f"{c['chunk']:>5} " + " ".join(f"{c[p]:>10.2f}s" for p in PARTS) + f" {c['wall']:>10.2f}s")
    med = {p: statistics.median(c[p] for c in chunks) for p in (*PARTS, "wall")}
    print(f"{'med':>5} " + " ".join(f"{med[p]:>10.2f}s" for p in PARTS) + f" {med['wall']:>10.2f}s")
    orchestration = sum(med[p] for p in AIRFLOW_RAY)
    boundary = med["wall"] - med["training"]
    print(
        f"\nper chunk boundary (medians): Airflow + Ray add {orchestration:.1f}s "
        f"({', '.join(f'{p} {med[p]:.1f}s' for p in AIRFLOW_RAY)}); the trainer's start-up "
        f"{med['startup']:.1f}s, its save {med['save']:.1f}s and validation {med['validation']:.1f}s come on top"
    )
    print(
        f"ratio to the demo chunk's wall time ({med['wall']:.1f}s, baseline): Airflow + Ray "
        f"{orchestration / med['wall']:.1%}; everything but the steps {boundary / med['wall']:.1%}"
    )
    for minutes in (60,):
        print(
            f"projected for {minutes}-minute GPU chunks: Airflow + Ray {orchestration:.1f}s = "
            f"{orchestration / (minutes * 60):.2%} of the chunk (goal < 1%); with this CPU trainer's start-up and "
            f"validation too: {(orchestration + med['startup'] + med['validation']) / (minutes * 60):.2%}"
        )


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
        report(measure(spec.run_dir(run)))
        if os.environ.get("RELAY_BENCH_NO_VERL"):
            return 0
        # verl's own chunk on the CPU path, on the same head: what its start-up costs (bench/verl_startup.py)
        return verl_startup.main(stack.ray_address())
    finally:
        if started:
            stack.down()


if __name__ == "__main__":
    sys.exit(main())
