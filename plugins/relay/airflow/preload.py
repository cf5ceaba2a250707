"""What Relay's tasks import, imported once by a LocalExecutor scheduler before it forks its workers.

With the LocalExecutor every task process is a fork of a worker, and every worker a fork of the scheduler
(airflow/executors/local_executor.py; the task SDK's supervisor forks once more per task). A module the
scheduler has imported, each task starts with; any other, each task imports again: torch for the gate, the
tiny model's transformers classes for its smoke check, boto3 for a publish, matplotlib for the report, Ray's job
client for a train task, Relay's Airflow modules for the DAG file each task parses. On the demo, the task
processes take a fraction of the CPU they take without it, for a few CPU-s once in the scheduler (the figures:
docs/benchmarks.md).

relay.devstack.stack runs it through $AIRFLOW_HOME/config/airflow_local_settings.py (stack.LOCAL_SETTINGS),
which every Airflow process imports at start-up; it acts only in `airflow scheduler` with the LocalExecutor
(RELAY_PRELOAD=0: off). Not in plugins/: Airflow's plugin loader imports every module there, in task processes
too. Left to the tasks: pyarrow (its import starts a thread) and great-expectations (seconds, skipped by a remembered
pass).
"""

from __future__ import annotations

import importlib
import os
import sys
import time

TASK_MODULES = (
    "torch",
    "torch.distributed.tensor",
    "transformers.modeling_utils",
    "transformers.models.qwen2.modeling_qwen2",
    "boto3",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "ray.job_submission",
    "relay.airflow.dag_factory",
    "relay.airflow.tasks",
    "relay.preflight.admission",
    "relay.insights.report",
    "relay.s3.store",
)


def preload_task_modules(argv: list[str] | None = None) -> list[str]:
    """Import TASK_MODULES when this process is `airflow scheduler` with the LocalExecutor; the names imported.
    A module that fails to import is skipped: the task that needs it imports it itself and says why."""
    argv = sys.argv if argv is None else argv
    if argv[1:2] != ["scheduler"] or os.environ.get("RELAY_PRELOAD", "1") == "0":
        return []
    from airflow.configuration import conf

    if "LocalExecutor" not in conf.get("core", "executor", fallback=""):
        return []
    done, t0 = [], time.process_time()
    for name in TASK_MODULES:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as e:  # noqa: BLE001 - a missing library must not stop the scheduler
            print(f"[relay] preload: {name} not imported ({type(e).__name__}: {e})", file=sys.stderr)
    print(
        f"[relay] the scheduler imported {len(done)} modules for its task processes in {time.process_time() - t0:.1f} CPU-s",
        file=sys.stderr,
    )
    return done
