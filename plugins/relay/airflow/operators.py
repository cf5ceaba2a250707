"""RayChunkOperator: one chunk of a run as one Ray job; deferrable while the job trains.

execute():
  1. The chunk is done when the run's latest valid checkpoint has reached its end step: finish at
     once, with success (a skip would cascade to the later chunks).
  2. This try's job already exists (same deterministic submission id): re-attach to it.
  3. Otherwise stop every live job of this run (one writer per run), submit, and defer.
execute_complete(): succeed only when the job succeeded and the run's checkpoint reached the end step.
"""

from __future__ import annotations

import time
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from relay.airflow.hooks import RayJobsHook
from relay.airflow.triggers import RayChunkJobTrigger
from relay.plan import ChunkPlan
from relay.ray_jobs import LIVE, job_metadata, submission_id
from relay.spec import load_spec
from relay.trainers.contract import ChunkRequest
from relay.validate import latest_valid_step


class RayChunkOperator(BaseOperator):
    ui_color = "#e8f0fe"

    def __init__(self, *, spec_path: str, chunk_index: int, run_from_task: str = "preflight", **kwargs):
        super().__init__(**kwargs)
        self.spec_path = spec_path
        self.chunk_index = chunk_index
        self.run_from_task = run_from_task
        self._submission_id: str | None = None

    # ---------------------------------------------------------------------------- helpers
    def _spec_and_run(self, context) -> tuple[Any, str]:
        spec = load_spec(self.spec_path, check_environment=False)
        run = context["ti"].xcom_pull(task_ids=self.run_from_task)["run_name"]
        return spec, run

    def _done(self, spec, run: str, chunk, how: str) -> dict:
        latest = latest_valid_step(spec.run_dir(run))
        if not chunk.done_by(latest):
            raise AirflowException(
                f"{chunk} of run {run}: the job ended but the latest valid checkpoint is step {latest}, not "
                f"{chunk.end_step}. The retry resumes from step {latest or 0}."
            )
        self.log.info("%s of run %s: done (%s); latest checkpoint step %s", chunk, run, how, latest)
        return {"run_name": run, "chunk": chunk.index, "end_step": chunk.end_step, "latest_step": latest,
                "how": how}

    # ---------------------------------------------------------------------------- execute
    def execute(self, context) -> dict:
        spec, run = self._spec_and_run(context)
        chunk = ChunkPlan.from_spec(spec).chunk(self.chunk_index)
        latest = latest_valid_step(spec.run_dir(run))
        if chunk.done_by(latest):
            return self._done(spec, run, chunk, f"already reached step {latest}; nothing to train")

        ti = context["ti"]
        dag_run_id = context["dag_run"].run_id
        sub_id = submission_id(spec.name, run, dag_run_id, chunk.index, ti.try_number)
        self._submission_id = sub_id
        hook = RayJobsHook(spec.ray.conn_id)
        existing = hook.jobs.get(sub_id)
        if existing is None:
            stopped = hook.jobs.stop_run(spec.name, run, keep=sub_id)
            if stopped:
                self.log.warning("stopped live jobs of run %s before submitting (one writer per run): %s",
                                 run, stopped)
            req = ChunkRequest(spec=spec, run_name=run, to_step=chunk.end_step, chunk=chunk.index, attempt=sub_id)
            hook.jobs.submit(req, sub_id, job_metadata(req, dag_run_id, ti.try_number))
            self.log.info("%s of run %s: resumes from step %s; submitted Ray job %s to %s",
                          chunk, run, latest or 0, sub_id, hook.address)
        elif existing.status == "SUCCEEDED":
            return self._done(spec, run, chunk, f"job {sub_id} had already succeeded")
        elif existing.status in LIVE:
            self.log.info("re-attaching to Ray job %s (%s) instead of submitting a second one", sub_id,
                          existing.status)
        else:
            raise AirflowException(f"Ray job {sub_id} of this try already ended {existing.status}: "
                                   f"{existing.message}. The next try resumes from the latest checkpoint.")

        deadline = time.time() + spec.ray.chunk_timeout_minutes * 60
        self.defer(
            trigger=RayChunkJobTrigger(address=hook.address, submission_id=sub_id, deadline=deadline,
                                       poll_seconds=spec.ray.poll_seconds),
            method_name="execute_complete",
        )

    def execute_complete(self, context, event: dict) -> dict:
        spec, run = self._spec_and_run(context)
        chunk = ChunkPlan.from_spec(spec).chunk(self.chunk_index)
        if event["status"] != "SUCCEEDED":
            raise AirflowException(
                f"{chunk} of run {run}: Ray job {event['submission_id']} ended {event['status']}: "
                f"{event['message']}\n--- last lines of the job's log ---\n{event.get('log_tail', '')}"
            )
        return self._done(spec, run, chunk, f"job {event['submission_id']} succeeded")

    def on_kill(self) -> None:
        """The task was killed while in execute(): stop its job (a deferred task is the trigger's on_kill)."""
        if self._submission_id:
            spec = load_spec(self.spec_path, check_environment=False)
            RayJobsHook(spec.ray.conn_id).jobs.stop(self._submission_id)
