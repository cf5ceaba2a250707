"""A run from its spec to its trained steps, as `relay plan`, `relay spec check` and `relay train` take it: the
plan and what the run has done, the spec's checks, the run prepared as the DAG's preflight.run prepares it (its
incarnation, a confirmed fresh start), its checkpoint taken to the spec's world size, and a chunk trained in this
process or followed as a Ray job (where that job runs, the front-end decides).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.checkpoints.validate import latest_step_or_problem, latest_valid_step
from relay.common.errors import RelayError
from relay.jobs import chunk_job, local_head
from relay.jobs.ray_jobs import STOP_MARGIN_S, JobState, RayJobs
from relay.ops import elastic
from relay.preflight.prepare import RunState, prepare_run
from relay.runs import failure_cause, layout
from relay.runs.phases import record_job_times
from relay.runs.run import Run
from relay.s3.store import CheckpointStore, store_for_spec
from relay.spec.kinds import KINDS, WorldOption
from relay.spec.plan import ChunkPlan
from relay.spec.run_spec import RunSpec
from relay.trainers.contract import ChunkRequest, ChunkResult, run_chunk


def plan(spec: RunSpec, run_name: str | None) -> tuple[str, str | None]:
    """The spec's chunk plan, each chunk marked done or to do against the run's latest checkpoint, and a warning
    when that checkpoint cannot be read."""
    run = Run.of(spec, run_name)
    latest, problem = latest_step_or_problem(run.dir)
    head = f"spec {spec.source} -> DAG {spec.dag_id}; run dir {run.dir}"
    return f"{head}\n{ChunkPlan.from_spec(spec).describe(latest)}", problem


def next_world_size(spec: RunSpec, run_name: str | None, address: str) -> str | None:
    """An elastic spec: what size the run's next chunk would train at on the cluster at `address`, and why."""
    return elastic.next_size(Run.of(spec, run_name), address)


@dataclass
class SpecCheck:
    """A valid spec's summary, its resume-critical settings, and its kind's environment check when it warns."""

    summary: list[str]
    critical: dict[str, Any]
    warning: str | None = None


def check_spec(spec: RunSpec) -> SpecCheck:
    """What `relay spec check` says of a spec that loaded (a spec that does not is a SpecError before this)."""
    summary = [
        f"spec {spec.source}: valid (DAG {spec.dag_id}, trainer {spec.trainer.kind}, "
        f"{spec.total_steps} steps in chunks of {spec.chunk_steps})",
        f"resume-critical settings fingerprint: {spec.settings_fingerprint()}",
    ]
    found = KINDS[spec.trainer.kind].check_environment(spec)
    warning = f"attention: {found.detail}\n    fix: {found.fix}" if found is not None and not found.ok else None
    return SpecCheck(summary, spec.resume_critical(), warning)


def store_of(spec: RunSpec, *, offline: bool) -> CheckpointStore | None:
    """The spec's S3 store, or None offline (nothing restored from S3, the published run not looked at)."""
    return store_for_spec(spec) if spec.s3 is not None and not offline else None


def prepare(
    spec: RunSpec,
    run_name: str,
    *,
    fresh_start: bool,
    confirm: str,
    started_by: str,
    store: CheckpointStore | None,
    jobs: RayJobs | None,
    asked_by: str | None = None,
) -> RunState:
    """The DAG's preflight.run, by the same code: the run's incarnation, and a confirmed fresh start (the old run
    moved aside, locally and in S3, never deleted; once per `asked_by`, a DAG run's id)."""
    return prepare_run(
        spec,
        run_name,
        fresh_start=fresh_start,
        confirm=confirm,
        started_by=started_by,
        store=store,
        jobs=jobs,
        asked_by=asked_by,
    )


def train_as_job(
    run: Run,
    to_step: int,
    *,
    address: str | None,
    private_head: Callable[[], Any],
    offline: bool,
    say: Callable[[str], None],
    warn: Callable[[str], None],
) -> JobOutcome:
    """`relay train` of a kind whose chunks run as Ray jobs: the chunk as the DAG's Ray job, on the cluster at
    `address`, else on `private_head()` (a head of the command's own that ends with it); its log on stdout. SIGTERM
    and SIGHUP stop the job (and the private head) as Ctrl-C does: a KeyboardInterrupt (see `interrupted`)."""
    with chunk_job.interrupts():
        with local_head.guarded(address) if address else private_head() as where:
            say(f"run {run.name}: training to step {to_step} as a Ray job on {where.address}")
            state, warning = follow_job(
                RayJobs(where.address), run, to_step, offline=offline, watch=where.watch_job, say=say
            )
            if warning:
                warn(warning)
    return job_outcome(run, state, to_step, address=where.address)


def interrupted(e: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped a command (a signal's name, or Ctrl-C) and its exit code: 128 + the signal's number."""
    return (str(e) if isinstance(e, chunk_job.Interrupted) else "Ctrl-C"), chunk_job.exit_code(e)


def runs_as_job(spec: RunSpec) -> bool:
    """Whether the spec's chunks train as Ray jobs (its kind's `ray_job`); else in this process."""
    return chunk_job.runs_as_job(spec)


def train_here(run: Run, to_step: int, *, offline: bool) -> ChunkResult:
    """Train the run to `to_step` in this process, resuming from its latest valid checkpoint (restored from S3
    unless offline)."""
    chunk = chunk_job.chunk_index(run.spec, to_step)
    return run_chunk(ChunkRequest(run=run, to_step=to_step, chunk=chunk, restore=not offline))


def follow_job(
    jobs: RayJobs,
    run: Run,
    to_step: int,
    *,
    offline: bool,
    watch: Callable[..., Any] | None = None,
    say: Callable[[str], None] = print,
) -> tuple[JobState, str | None]:
    """Submit the chunk as the DAG's Ray job and follow it to its end, its log on stdout (Ctrl-C or SIGTERM stops
    it: chunk_job.interrupts); then its start and end for the goodput ledger. An elastic run's world size is chosen
    first, waiting here while the cluster holds too little (`say` tells what it waits for). (the job's state, a
    warning)"""
    sub_id = chunk_job.local_submission_id(run)
    chunk = chunk_job.chunk_index(run.spec, to_step)

    def size() -> WorldOption | None:  # an elastic run's world size, waited for here while the cluster holds too little
        sized = elastic.wait_here(run, jobs.address, store_of(run.spec, offline=offline), chunk=chunk, say=say)
        if sized is not None:
            say(f"run {run.name}: world size {sized.world_size}: {sized.why}")
            if sized.resharded is not None:
                say(sized.resharded.done)
        return sized.option if sized is not None else None

    state = chunk_job.run_attached(
        jobs,
        sub_id,
        lambda: chunk_job.submit_chunk(jobs, run, to_step, sub_id, not offline, size=size),
        watch=watch,
        stop_wait_s=run.spec.ray.stop_grace_seconds + STOP_MARGIN_S,
    )
    try:
        record_job_times(run.dir, jobs.get(state.submission_id), chunk=chunk_job.chunk_index(run.spec, to_step))
    except (OSError, RelayError) as e:  # never fails the command
        return state, f"the times of Ray job {state.submission_id} were not recorded ({e})"
    return state, None


@dataclass
class JobOutcome:
    """What a followed job did: the command's exit code and what it says (`errors` on stderr)."""

    code: int
    said: str = ""
    errors: list[str] = field(default_factory=list)


def job_outcome(run: Run, state: JobState, to_step: int, *, address: str | None = None) -> JobOutcome:
    """A job that failed is classified and recorded (events.jsonl: chunk_failed), as the train task does (a node of
    the cluster at `address` that died while it ran is its cause); one that succeeded must have left the run's
    latest valid checkpoint at `to_step`."""
    if state.status != "SUCCEEDED":
        what, code = chunk_job.failure(state)
        cause = failure_cause.classify(
            state.status,
            state.message,
            exit_code=state.exit_code,
            step=failure_cause.step_of_failure(run.dir, state.submission_id),
            oom_kills=failure_cause.oom_kills_since_start(run.dir, state.submission_id),
            lost_nodes=elastic.lost_nodes(address, run, state.submission_id) if address else None,
        )
        failure_cause.record_failure(
            run.dir, cause, chunk=chunk_job.chunk_index(run.spec, to_step), attempt=state.submission_id
        )
        said = f"Ray job {state.submission_id} of run {run.name} {what} (its log is above)"
        return JobOutcome(code, errors=[said, *cause.report().splitlines()])
    latest = latest_valid_step(run.dir)
    if latest is None or latest < to_step:
        return JobOutcome(
            1,
            errors=[
                f"Ray job {state.submission_id} succeeded, but run {run.name}'s latest valid checkpoint is step "
                f"{latest or 0}, not {to_step}"
            ],
        )
    return JobOutcome(
        0, f"run {run.name}: Ray job {state.submission_id} succeeded; checkpoint {layout.step_dir(run.dir, latest)}"
    )


def make_tiny_model(folder: Path) -> Path:
    """A tiny model to train on a CPU, no download (`relay model tiny`): the one a registered kind offers."""
    maker = next(k for k in KINDS.values() if k.tiny_model)
    made: Path = maker.make_tiny_model(folder)
    return made
