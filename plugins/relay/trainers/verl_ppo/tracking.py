"""One tracking run per training run, not one per chunk.

verl's Tracking starts a new wandb/MLflow run in every process, so each chunk would be a curve of
its own. Every chunk of a training run gets the same ids instead:

- wandb: WANDB_RUN_ID (derived from the run: spec, run name and the run record's creation time, so a
  fresh start, which archives the old folder, gets a new one) with WANDB_RESUME=allow;
- MLflow: verl reads MLFLOW_RUN_ID; the run that chunk 1 started is recorded in
  <run>/.relay/tracking.json and every later chunk resumes it;
- tensorboard and file loggers write under project/experiment names that Relay fixes per run.

Pure Python: the Airflow side computes the job's environment from here without importing verl.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from relay.common import files
from relay.runs import layout
from relay.runs.record import read_record
from relay.runs.run import Run

RECORD = "tracking.json"


def project_name(spec) -> str:
    return spec.settings.project_name or f"relay-{spec.name}"


def experiment_name(run: Run) -> str:
    return run.spec.settings.experiment_name or run.name


def wandb_run_id(run: Run) -> str:
    """Stable for a training run; another after a fresh start (the run record is new then)."""
    created = read_record(run.dir).get("created", "")
    digest = hashlib.sha256(f"{run.spec.name}/{run.name}/{created}".encode()).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', run.name)[:48]}-{digest}"


def read(run_dir: Path) -> dict:
    try:
        return json.loads(layout.relay_dir(run_dir, RECORD).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def job_env(run: Run) -> dict[str, str]:
    """Environment every chunk's job gets, so that all chunks of the run log to one tracking run."""
    env = {"WANDB_RUN_ID": wandb_run_id(run), "WANDB_RESUME": "allow"}
    if mlflow_id := read(run.dir).get("mlflow_run_id"):
        env["MLFLOW_RUN_ID"] = mlflow_id
    return env


def record_active(run_dir: Path, loggers) -> dict:
    """In the trainer, once verl's Tracking has started: keep the MLflow run id for the later chunks."""
    rec = read(run_dir)
    names = [loggers] if isinstance(loggers, str) else list(loggers or [])
    if "mlflow" in names and not rec.get("mlflow_run_id"):
        import mlflow

        active = mlflow.active_run()
        if active is not None:
            rec["mlflow_run_id"] = active.info.run_id
            files.atomic_write_json(layout.relay_dir(run_dir, RECORD), rec)
    return rec


def apply_env(env: dict[str, str]) -> None:
    """In the TaskRunner actor, before verl's Tracking starts: ids the job's environment lacks."""

    for k, v in env.items():
        os.environ.setdefault(k, v)
