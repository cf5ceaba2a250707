"""A chunk's checkpoint through the gate, as its validate task takes it: where the checkpoint lives (this worker,
or a Ray job on the cluster with spec checkpoints.validate_on: ray), and the verdict a front-end acts on.

An invalid checkpoint is quarantined by the gate (relay.preflight.admission) and the tracker falls back to the
newest valid one; the verdict says which check failed and what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relay.checkpoints import manifest
from relay.common.errors import RelayError
from relay.jobs.ray_jobs import LOG_TAIL_LINES, RayJobs, submission_id
from relay.ops.train_chunk import Try
from relay.preflight import admission
from relay.runs.layout import checkpoint_reached, step_dir
from relay.runs.run import Run
from relay.spec.plan import Chunk


def admitted_before(run: Run, chunk: Chunk, trained_how: str) -> bool:
    """Whether an earlier gate admitted the chunk's checkpoint (perhaps pruned by retention since): its train task
    found the chunk done, and the step's folder is gone or has its manifest. A checkpoint that reached the end step
    without one (its job was stopped after the commit) is validated again."""
    here = step_dir(run.dir, chunk.end_step)
    return trained_how.startswith("already reached") and (not here.is_dir() or manifest.read(here) is not None)


def reached(run: Run, chunk: Chunk) -> bool:
    """Whether the chunk's end step is committed, so the gate can judge it now (else wait for it)."""
    return checkpoint_reached(run.dir, chunk.end_step)


def admit_here(run: Run, chunk: Chunk, *, expected_step: int | None) -> dict[str, Any]:
    """The gate in this process: the admission as a dict (ok, checks, quarantined_to, fell_back_to)."""
    return admission.admit(run, chunk.end_step, expected_step=expected_step).to_dict()


def start_on_ray(jobs: RayJobs, run: Run, chunk: Chunk, at: Try, *, expected_step: int | None) -> str:
    """The gate as a Ray job on the cluster, where the checkpoint lives: submitted once per try (a re-run of the
    try follows the job it submitted). Its submission id."""
    spec = run.spec
    sub_id = submission_id(spec.name, run.name, at.dag_run, chunk.index, at.number) + "-validate"
    if jobs.get(sub_id) is None:
        request = admission.request_json(run, chunk.end_step, expected_step)
        metadata = {"relay_spec": spec.name, "relay_run": run.name, "relay_role": "validate"}
        jobs.submit_module(spec, "relay.preflight.admission", {admission.ENV_VAR: request}, sub_id, metadata)
    return sub_id


class NoVerdict(RelayError):
    """The gate's Ray job ended without printing its admission."""

    retry_helps = True  # a retry validates again


def admission_of_job(jobs: RayJobs, sub_id: str) -> dict[str, Any]:
    """The admission the gate's Ray job printed; NoVerdict with its log's last lines when it printed none."""
    logs = jobs.logs(sub_id)
    found = admission.parse_job_output(logs)
    if found is None:
        tail = "\n".join(logs.splitlines()[-LOG_TAIL_LINES:])
        raise NoVerdict(f"validation job {sub_id} printed no result:\n{tail}", "read the job's log; a retry validates again")
    return found


@dataclass(frozen=True)
class Verdict:
    """The gate's verdict on a chunk's checkpoint, in the words its task logs and alerts with."""

    ok: bool
    report: str  # one line per check
    check: str = ""  # the check that failed
    detail: str = ""  # why
    quarantined_to: str = ""
    action: str = ""  # what Relay did, and what a person does next

    @property
    def failed(self) -> str:
        """The failed check and why."""
        return f"{self.check}: {self.detail}"


def verdict(chunk: Chunk, found: dict[str, Any]) -> Verdict:
    """The verdict of an admission (admit_here's or admission_of_job's)."""
    report = "\n".join(f"  {'✔' if c['ok'] else '✘'} {c['name']}: {c['detail']}" for c in found["checks"])
    if found["ok"]:
        return Verdict(True, report)
    failed = next(c for c in found["checks"] if not c["ok"])
    back = found["fell_back_to"] or "none"
    return Verdict(
        False,
        report,
        failed["name"],
        failed["detail"],
        found["quarantined_to"],
        f"quarantined it (never published) and pointed the tracker at step {back}; this DAG run stops. "
        f"Clear {chunk.task_group_id}.train to train the chunk again from there.",
    )
