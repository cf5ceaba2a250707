"""A chunk's Ray job, submitted or adopted in one place: the DAG's train task and `relay train` both go
through here, so one writer per run holds whoever starts the job.

decide(): what a train task's try does about its chunk's job, in this order:
  0. a job of the run went on warm into this chunk (relay.runs.handoff) and still runs under the run's lease with
     the spec this try loaded: take it over ("warm"; the caller admits it). With another spec it is refused (it
     stops without committing) and the chunk starts cold;
  1. this try's job already exists (its deterministic submission id): re-attach to a live one; a
     succeeded one is done; one that ended otherwise is the try's failure (the next try resumes);
  2. a live job of this chunk from an earlier try still trains well (it holds the run's lease and made
     a step within the stall limit, or is within its start-up allowance): adopt it, so that a try that
     failed for a reason of Airflow's own never throws a healthy job's steps away;
  3. otherwise submit a new one.
submit_chunk(): stop the run's other live jobs when asked (each gets its grace to save the step it is
in), take the run's lease for the new job (its fencing token travels in the request: a stale job that
starts late finds a newer token and never writes), and submit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from relay.jobs.ray_jobs import LIVE, JobState, RayJobs
from relay.runs import handoff
from relay.runs.metrics import MetricsLog
from relay.runs.run import Run
from relay.spec.kinds import WorldOption
from relay.spec.plan import Chunk
from relay.trainers.contract import ChunkRequest

WORLD_SIZE_KEY = "relay_world_size"  # the job's metadata: an elastic spec's world size it trains at
WORLD_NODES_KEY = "relay_world_nnodes"  # and on how many nodes

Action = Literal["warm", "reattach", "adopt", "submit", "succeeded", "ended"]


@dataclass(frozen=True)
class JobDecision:
    action: Action
    submission_id: str  # the job to follow (an adopted one's own id), or the one to submit
    why: str = ""  # an adoption's reason, in a log's words
    state: JobState | None = None  # what Ray said of the job, when it exists


def decide(
    jobs: RayJobs,
    run: Run,
    chunk: Chunk,
    sub_id: str,
    *,
    remembered: str | None,
    stall_limit_s: float,
    warn: Callable[[str], None],
    grow: Callable[[JobState], str | None] | None = None,
) -> JobDecision:
    """What this try does about its chunk's job (see the module's docstring). remembered: the submission id
    an earlier try stored in Airflow's task state; warn: where a passed-over earlier job is said; grow: why a warm
    job should start cold instead to train at a larger world size (relay.ops.elastic), None when not."""
    if (warm := warm_job(jobs, run, chunk, warn=warn, grow=grow)) is not None:
        return warm
    existing = jobs.get(sub_id)
    if existing is not None:
        action: Action = (
            "succeeded" if existing.status == "SUCCEEDED" else "reattach" if existing.status in LIVE else "ended"
        )
        return JobDecision(action, sub_id, state=existing)
    if (
        adopted := healthy_earlier_job(jobs, run, chunk, remembered=remembered, stall_limit_s=stall_limit_s, warn=warn)
    ) is not None:
        job, why = adopted
        return JobDecision("adopt", job.submission_id, why, job)
    return JobDecision("submit", sub_id)


def warm_job(
    jobs: RayJobs,
    run: Run,
    chunk: Chunk,
    *,
    warn: Callable[[str], None],
    grow: Callable[[JobState], str | None] | None = None,
) -> JobDecision | None:
    """The job that went on warm into this chunk, if this try can take it over (see the module's docstring)."""
    record = handoff.warm(run.dir, chunk.index)
    if record is None:
        return None
    attempt = str(record.get("attempt"))
    state = jobs.get(attempt)
    if state is None or state.status not in LIVE or not run.folder.lease().holds(attempt):
        return None  # it ended (a kill, a stop) or was fenced out: this chunk starts cold
    if record.get("spec") != handoff.spec_digest(run.spec.to_json()):
        handoff.refuse(run.dir, chunk.index, "the run's spec changed since the job started: the chunk starts cold")
        warn(
            f"Ray job {attempt} went on warm into {chunk}, but the run's spec changed since it started: it is refused "
            "(it stops without committing) and the chunk starts a new job"
        )
        return None
    if grow is not None and (larger := grow(state)) is not None:
        handoff.refuse(run.dir, chunk.index, f"{larger}: the chunk starts cold to grow")
        warn(f"Ray job {attempt} went on warm into {chunk}, but {larger}: it is refused and the chunk starts cold")
        return None
    why = f"it committed step {record.get('from_step')} and went on warm into this chunk (lease token {record.get('token')})"
    return JobDecision("warm", attempt, why, state)


def healthy_earlier_job(
    jobs: RayJobs, run: Run, chunk: Chunk, *, remembered: str | None, stall_limit_s: float, warn: Callable[[str], None]
) -> tuple[JobState, str] | None:
    """A live job of this chunk that an earlier try submitted and that still trains well: it holds the run's
    lease (a newer attempt fenced it out otherwise) and made a step within the stall limit (or is still
    within its start-up allowance). (job, why) or None."""
    startup_s = run.spec.alerts.startup_minutes * 60
    # Airflow remembers the id once it was stored; a worker killed between the submission and that
    # write leaves it unstored, and the job's metadata (run, chunk) finds it all the same.
    candidates = sorted(
        jobs.live_jobs_of_run(run.spec.name, run.name), key=lambda j: (j.submission_id != remembered, -(j.start_time or 0))
    )
    lease = run.folder.lease()
    ours = [j for j in candidates if j.metadata.get("relay_chunk") == str(chunk.index) and lease.holds(j.submission_id)]
    rows = MetricsLog(run.dir).rows() if ours else []
    for job in ours:
        steps = [r for r in rows if r.get("attempt") == job.submission_id]
        limit = stall_limit_s
        if steps:
            idle = time.time() - float(steps[-1].get("time") or 0)
            why = f"it holds the run's lease and made step {steps[-1]['step']} {idle:.0f}s ago"
            if steps[-1]["step"] >= chunk.end_step:  # saving: the same allowance as the trigger's
                limit += startup_s
        else:
            limit += startup_s
            idle = time.time() - (job.start_time or 0)
            why = f"it holds the run's lease and started {idle:.0f}s ago, within its start-up allowance"
        if idle <= limit:
            return job, why
        warn(
            f"Ray job {job.submission_id} of an earlier try holds the lease but made no step for {idle:.0f}s "
            f"(limit {limit:.0f}s): it is stopped, not adopted"
        )
    return None


@dataclass(frozen=True)
class Submitted:
    request: ChunkRequest
    stopped: list[str]  # the run's other live jobs stopped first


def chunk_request(
    run: Run,
    to_step: int,
    sub_id: str,
    *,
    chunk: int | None,
    restore: bool = True,
    handoff: bool = False,
    world: WorldOption | None = None,
) -> ChunkRequest:
    """The job's request, with the run's lease taken for sub_id now (the token travels in the request)."""
    token = run.folder.lease().acquire(sub_id)
    return ChunkRequest(
        run=run,
        to_step=to_step,
        chunk=chunk,
        attempt=sub_id,
        lease_token=token,
        restore=restore,
        handoff=handoff,
        world_size=world.world_size if world is not None else None,
        nnodes=world.nnodes if world is not None else None,
    )


def submit_chunk(
    jobs: RayJobs,
    run: Run,
    to_step: int,
    sub_id: str,
    *,
    chunk: int | None,
    metadata: Callable[[ChunkRequest], dict[str, str]],
    env: dict[str, str] | None = None,
    restore: bool = True,
    stop_others_wait_s: float | None = None,
    handoff: bool = False,
    size: Callable[[], WorldOption | None] | None = None,
) -> Submitted:
    """Submit the chunk's job under a lease taken for it. stop_others_wait_s: stop every other live job of the
    run first, waiting up to that long for each to save its step (the DAG's train task: one writer per run);
    None leaves them (`relay train`: a job of the run that still runs is fenced out by the new token). size: an
    elastic spec's world size for the job, chosen once the run's other jobs gave their GPUs back
    (relay.ops.elastic; it may raise to wait for nodes)."""
    stopped = (
        [] if stop_others_wait_s is None else jobs.stop_run(run.spec.name, run.name, keep=sub_id, wait_s=stop_others_wait_s)
    )
    world = size() if size is not None else None
    req = chunk_request(run, to_step, sub_id, chunk=chunk, restore=restore, handoff=handoff, world=world)
    meta = metadata(req)
    if world is not None:
        # a warm job's size: the next chunk grows it back (relay.ops.elastic)
        meta.update({WORLD_SIZE_KEY: str(world.world_size), WORLD_NODES_KEY: str(world.nnodes)})
    # (the trainer kind's job_env, e.g. verl's cpu platform for device cpu, is added by RayJobs.submit)
    jobs.submit(req, sub_id, meta, env)
    return Submitted(req, stopped)
