"""verl's main_ppo as one Relay chunk: the job's driver.

`python -m relay.trainers.job` (the Ray job's entrypoint) -> run_chunk -> train_chunk here:

1. take the run's lease; move rollout-engine state out of the step folders (hygiene);
2. find the resume point (every validation level, quarantine, fallback, restore from S3: the
   same ChunkSession as every trainer); refuse a world-size or FSDP-version change; check that
   verl's own lookup names the same checkpoint;
3. check verl's contract (where its TaskRunner looks the trainer up; what keeps the LR horizon)
   and choose how the chunk ends (horizon.chunk_strategy);
4. build the Hydra overrides from the spec, compose verl's ppo_trainer.yaml, run verl's own
   config validation, add the chunk for the TaskRunner;
5. run verl's run_ppo() with Relay's TaskRunner (the chunk trainer is installed inside the actor),
   printing a progress line per step from metrics.jsonl (the actor writes the rows; Ray prefixes
   an actor's own output, so the driver prints the lines the stall watch reads);
6. succeed only when the tracker has reached the chunk's end step; a SIGTERM (or the spec's save_before) makes
   the actor save the step it is in through verl's own save path and end the loop (StoppedEarly).

In supervised mode the same driver runs the whole run as one job (to the run's last step, saving
every chunk_steps); an Airflow retry of that job resumes it the same way.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

from relay.checkpoints import manifest
from relay.checkpoints.validate import write_manifest
from relay.common.errors import ChunkEndedEarly, RelayError
from relay.common.progress import step_line
from relay.common.timestamps import epoch
from relay.runs import layout
from relay.runs.metrics import JsonlFollower, read_events
from relay.runs.phases import phase_marks, record_phase
from relay.spec.plan import ChunkPlan
from relay.trainers import batches, stopping
from relay.trainers.contract import ChunkRequest, ChunkResult
from relay.trainers.session import ChunkSession, stop_of
from relay.trainers.stopping import GracefulStop
from relay.trainers.verl_ppo import horizon, hygiene, overrides, tracking, verl_chunk, verl_contract
from relay.trainers.verl_ppo.horizon import describe_schedule
from relay.trainers.verl_ppo.runner import task_runner_class


def resolved_settings(spec, train_rows: int | None = None) -> dict:
    """What the trainer derives from the spec and would run with, beyond the spec's own keys."""
    lr_schedule = describe_schedule(spec.settings.optim, spec.total_steps)
    return batches.resolved_settings(spec, train_rows, lr_schedule=lr_schedule)


def job_env(req: ChunkRequest) -> dict[str, str]:
    """Environment of a verl chunk's Ray job, on top of Relay's own (ray_jobs.runtime_env).

    RAY_OVERRIDE_JOB_RUNTIME_ENV=1: verl's run_ppo calls ray.init with its own runtime_env inside the
    job; Ray merges it with the job's and, without this, refuses any key both name.
    device cpu: verl's cpu platform in every verl process of the job (verl_contract.CPU_PLATFORM_ENV).
    """

    cpu = verl_contract.CPU_PLATFORM_ENV if req.spec.settings.device == "cpu" else {}
    return {"RAY_OVERRIDE_JOB_RUNTIME_ENV": "1", "HYDRA_FULL_ERROR": "1", **cpu, **tracking.job_env(req.run)}


def tracking_env(req: ChunkRequest) -> dict[str, str]:
    """The ids this job's tracking uses: the job's environment first (set at submission), else derived."""
    env = job_env(req)
    return {k: os.environ.get(k, v) for k, v in env.items() if k.startswith(("WANDB_", "MLFLOW_"))}


def train_chunk(req: ChunkRequest) -> ChunkResult:
    spec = req.spec
    s = spec.settings
    run_dir = req.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if req.lease_token is None:
        req.lease_token = req.run.folder.lease().acquire(f"local:{socket.gethostname()}:{os.getpid()}")
    # before anything validates or loads the folders (the async modes resume what is in flight from it)
    moved = hygiene.remove_rollout_state(run_dir) if s.trainer_mode == "sync" else []
    # verl trains in its TaskRunner actor, which Ray does not signal: a SIGTERM here, once verl's loop runs (its
    # first_step_begins mark), is passed on through the attempt's stop file, which the actor reads after each step
    # (relay.trainers.stopping); before it, the driver ends at once.
    session = ChunkSession(
        req,
        forward_stop=lambda why: stopping.request_stop(run_dir, req.attempt, why),
        training_started=lambda: "first_step_begins" in phase_marks(read_events(run_dir), req.attempt),
    )
    if moved:
        session.say(
            f"moved rollout-engine state out of the checkpoints (kept in .relay/{hygiene.ASIDE}/): " + ", ".join(moved)
        )
    start = session.resume_step
    if start >= req.to_step:
        session.say(f"run {req.run.name} already reached step {start} >= {req.to_step}: nothing to train")
        return ChunkResult(req.run.name, start, start, 0, 0.0, str(layout.step_dir(run_dir, start)))
    world = s.at(req.world_size, req.nnodes)  # an elastic spec's nnodes and GPUs per node chosen for this job
    if s.elastic:
        session.say(
            f"world size {world.world_size} of {s.world_size_text()} (nnodes {world.nnodes} x {world.n_gpus_per_node})"
        )
    hygiene.check_parallelism(spec, run_dir, start, session.resume.report, world)
    hygiene.check_tracker_agrees(run_dir, start)
    if start and session.resume.report is not None and manifest.read(layout.step_dir(run_dir, start)) is None:
        # A checkpoint no gate saw (a mid-chunk save, a restore): the resume just validated it at every
        # level; its manifest lets the trainer re-check the bytes right before verl's loader reads them.
        write_manifest(session.resume.report, req.run.name, spec.settings_fingerprint())

    # every touch point of verl's the chunk trainer relies on, before any GPU time (relay.trainers.verl_ppo.verl_contract)
    verl_contract.require(cpu=s.device == "cpu")
    strategy = horizon.LOOP_BOUND if s.mode == "supervised" else horizon.chunk_strategy(spec)
    if strategy != horizon.LOOP_BOUND:
        session.say(
            f"verl's loop bound cannot be lowered safely here; the schedule "
            f"{horizon.describe_schedule(s.optim, spec.total_steps)} does not depend on the horizon, so "
            f"the chunk ends through total_training_steps={req.to_step}"
        )
    data = session.data_files()
    if s.tiny_model:
        from relay.trainers.verl_ppo.cpu.tiny_model import ensure_tiny_model

        if ensure_tiny_model(s.model_path):
            session.say(f"made Relay's tiny model at {s.model_path} (tiny_model: true)")
    config = overrides.compose(
        overrides.chunk_overrides(
            req.run, first_step_of_run=start == 0, data=data, strategy=strategy, end_step=req.to_step, world=world
        )
    )
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    overrides.check_config(config)
    verl_chunk.attach(
        config,
        verl_chunk.VerlChunk(
            request=req.to_json(),
            resume_step=start,
            end_step=req.to_step,
            total_steps=spec.total_steps,
            strategy=strategy,
            validate_chunk_end=s.validate_every_chunk,
            test_freq=s.test_freq,
            tracking_env=tracking_env(req),
            run_dir=str(run_dir),
            # only a DAG's job goes on warm (relay train's ends at its --to-step, saved there as verl's last step)
            warm_chunk_steps=spec.chunk_steps if req.handoff and spec.warm_chunks and s.mode != "supervised" else 0,
            trainer_mode=s.trainer_mode,
        ),
    )

    session.begin()
    record_phase(run_dir, "resume_checked", chunk=req.chunk, attempt=req.attempt)
    watcher = ProgressWatcher(session, start, req.to_step)
    t0 = time.time()
    try:
        run_verl(config, session.stopping)
    finally:
        watcher.stop()
        latest = _tracker(run_dir)
        _last_chunk_of_job(session)  # a warm handoff in the actor: the chunk the job ended in
        session.finish(latest or start)
    if latest is None or latest < req.to_step:
        if (stopped := stop_of(run_dir, req.attempt)) is not None:  # the actor saved and stopped, as asked
            raise session.stopped_early(int(stopped["step"]), str(stopped["reason"]), record=False)
        raise ChunkEndedEarly(
            f"verl ended at step {latest or start}, before the chunk's end step {req.to_step}",
            "nothing, if it does not repeat: the retry resumes from the latest valid checkpoint; if "
            "it does, look in the job's log for what ended verl's loop (a worker group, the data)",
        )
    return ChunkResult(
        req.run.name, start, req.to_step, req.to_step - start, time.time() - t0, str(layout.step_dir(run_dir, req.to_step))
    )


def _last_chunk_of_job(session: ChunkSession) -> None:
    """The chunk the job trained last: its own, or the last one its actor went on into warm (its `chunk_start`
    events), so that the driver's end of the job, its checks and its result name that chunk."""
    req = session.req
    starts = [e for e in read_events(session.run_dir) if e.get("event") == "chunk_start" and e.get("attempt") == req.attempt]
    if starts and starts[-1].get("warm"):
        req.chunk, req.to_step = starts[-1]["chunk"], int(starts[-1]["to_step"])
        session.resume_step = int(starts[-1]["resumed_from"])
        session._t0 = epoch(starts[-1].get("time")) or session._t0  # its chunk_end's seconds: that chunk's


def run_verl(config, graceful: GracefulStop | None = None) -> None:
    """verl's run_ppo with Relay's TaskRunner. A Relay error raised in the actor keeps its exit code."""
    from verl.trainer.main_ppo import run_ppo

    runner = task_runner_class() if graceful is None else _SigtermBack(task_runner_class(), graceful)
    try:
        run_ppo(config, task_runner_class=runner)
    except Exception as e:  # ray.exceptions.RayTaskError wraps what the actor raised, as .cause
        cause = getattr(e, "cause", None)
        if isinstance(cause, RelayError):
            raise cause from None
        raise


class _SigtermBack:
    """The TaskRunner actor class as verl's run_ppo uses it (.remote(), .options()), putting Relay's SIGTERM handler
    back first: run_ppo calls ray.init just before, which installs one that exits the driver at once, and so
    would end verl's actors before they could save."""

    def __init__(self, actor_class, graceful: GracefulStop):
        self._actor_class, self._graceful = actor_class, graceful

    def remote(self, *args, **kwargs):
        self._graceful.install()
        return self._actor_class.remote(*args, **kwargs)

    def options(self, *args, **kwargs):
        self._graceful.install()
        return self._actor_class.options(*args, **kwargs)


def _tracker(run_dir) -> int | None:
    try:
        return layout.read_tracker(run_dir)
    except RelayError:
        return None


class ProgressWatcher:
    """Print `[relay] step N/T ...` for every metrics row the actor writes (the stall watch reads these)."""

    def __init__(self, session, start: int, end: int, poll_s: float = 2.0):
        self.session, self.last, self.end, self.poll_s = session, start, end, poll_s
        self.metrics = JsonlFollower(Path(session.run_dir) / layout.METRICS)  # each poll reads what was appended
        self._times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="relay-progress", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def poll(self) -> list[int]:
        printed = []
        for row in self.metrics.new_rows():
            step = row.get("step", 0)
            if step <= self.last or row.get("attempt") != self.session.req.attempt:
                continue
            self.last = step
            self._times.append(float(row.get("seconds") or 0.0))
            # (a warm handoff in the actor: the row's chunk, which ends where the plan says)
            chunk, end = row.get("chunk", self.session.req.chunk), self.end
            if chunk != self.session.req.chunk and step <= self.session.spec.total_steps:
                end = ChunkPlan.from_spec(self.session.spec).chunk_for_step(step).end_step
            self.session.say(step_line(step, self.session.spec.total_steps, chunk, end, self._times[-20:], row))
            printed.append(step)
        return printed

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()
