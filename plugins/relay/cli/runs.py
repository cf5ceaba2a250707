"""`relay plan`, `relay spec check`, `relay train` (in this process, or as the DAG's Ray job) and
`relay model tiny`: a run, from its spec to its trained steps."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from relay.checkpoints.validate import latest_step_or_problem, latest_valid_step
from relay.cli.shared import _new_folder, _ray_address, _ray_jobs_if_running, _say, _spec
from relay.common.errors import RelayError, StoreError
from relay.devstack import stack
from relay.jobs import chunk_job, local_head
from relay.jobs.ray_jobs import STOP_MARGIN_S, RayJobs
from relay.preflight.prepare import prepare_run
from relay.preflight.world_size import to_spec_world_size
from relay.runs import failure_cause, layout
from relay.runs.phases import record_job_times
from relay.runs.run import Run
from relay.s3.store import store_for_spec
from relay.spec.kinds import KINDS
from relay.spec.plan import ChunkPlan
from relay.trainers.contract import ChunkRequest, run_chunk


def cmd_plan(args) -> int:
    spec = _spec(args.spec, check_environment=False)
    run = Run.of(spec, args.run)
    latest, problem = latest_step_or_problem(run.dir)
    if problem:
        print(f"warning: {problem}", file=sys.stderr)
    print(f"spec {spec.source} -> DAG {spec.dag_id}; run dir {run.dir}")
    print(ChunkPlan.from_spec(spec).describe(latest))
    return 0


def cmd_spec_check(args) -> int:
    spec = _spec(args.spec)
    print(
        f"spec {spec.source}: valid (DAG {spec.dag_id}, trainer {spec.trainer.kind}, "
        f"{spec.total_steps} steps in chunks of {spec.chunk_steps})"
    )
    print(f"resume-critical settings fingerprint: {spec.settings_fingerprint()}")
    if args.verbose:
        for k, v in sorted(spec.resume_critical().items()):
            print(f"  {k} = {v!r}")
    found = KINDS[spec.trainer.kind].check_environment(spec)
    if found is not None and not found.ok:  # a warning: the spec is valid
        print(f"warning: attention: {found.detail}\n    fix: {found.fix}", file=sys.stderr)
    return 0


def cmd_train(args) -> int:
    spec = _spec(args.spec)
    run_name = args.run or spec.name
    if args.checkpoint_dir:
        run_dir = Path(args.checkpoint_dir).resolve()
        spec, run_name = spec.model_copy(update={"checkpoint_dir": str(run_dir.parent)}), run_dir.name
    if not 1 <= args.to_step <= spec.total_steps:
        print(f"--to-step must be within 1..{spec.total_steps}", file=sys.stderr)
        return 2
    store = store_for_spec(spec) if spec.s3 is not None and not args.offline else None
    try:
        # The DAG's preflight.run, by the same code: the run's incarnation, a confirmed fresh start.
        state = prepare_run(
            spec,
            run_name,
            fresh_start=args.fresh_start,
            confirm=args.confirm or "",
            started_by=f"relay train (local:{socket.gethostname()}:{os.getpid()})",
            store=store,
            jobs=_ray_jobs_if_running(args) if args.fresh_start else None,
        )
        for note in state.notes:
            print(f"warning: {note}", file=sys.stderr)
        if state.archived_to or state.archived_uri:
            print(
                f"fresh start of run {state.run_name}: the old run was moved aside to "
                f"{' and '.join(x for x in (state.archived_to, state.archived_uri) if x)}"
            )
        run = state.run(spec)
        _reshard_to_spec(run, store)
        if chunk_job.runs_as_job(spec):
            return _train_as_ray_job(args, run)
        result = run_chunk(
            ChunkRequest(
                run=run, to_step=args.to_step, chunk=chunk_job.chunk_index(spec, args.to_step), restore=not args.offline
            )
        )
    except StoreError as e:
        # The store's own fix speaks of publishing; here nothing was published or written yet.
        raise StoreError(
            e.what,
            "start the S3 server, or point AWS_ENDPOINT_URL and the AWS credentials at it; or "
            "train without S3 with --offline (nothing is restored from S3 and the published "
            "run is not looked at); nothing was written",
        ) from None
    print(
        f"run {result.run_name}: trained {result.steps_trained} steps ({result.resumed_from} -> {result.end_step}) "
        f"in {result.seconds:.1f}s; checkpoint {result.checkpoint}"
    )
    return 0


def _reshard_to_spec(run: Run, store) -> None:
    """checkpoints.on_world_size_change: reshard, as the DAG's reshard task does before each chunk: the latest
    checkpoint taken to the spec's world size (the original kept) and admitted, and S3's copy replaced by it. Before
    every `relay train`, so the one after a refused resume also finds the step it falls back to at the new size."""
    if run.spec.checkpoints.on_world_size_change != "reshard":
        return
    result = to_spec_world_size(run)
    if result is None:
        return
    print(f"run {run.name}: {result.explain()}")
    if store is not None and run.spec.s3 is not None:
        try:
            store.publish(run.folder, result.step)
        except StoreError as e:  # the local step is resharded and valid; the chunk's own saves publish again
            print(
                f"warning: S3's copy of step {result.step} is still the world-size-{result.from_world_size} one: {e}; "
                f"publish it when S3 answers: relay checkpoint publish {run.dir} {run.spec.s3.uri} --step {result.step}",
                file=sys.stderr,
            )


def _train_as_ray_job(args, run: Run) -> int:
    """A trainer kind whose chunks run as Ray jobs (verl_ppo): the chunk as the DAG's Ray job, its log on
    stdout. On the cluster at --ray-address, else RAY_ADDRESS, else the local stack's head when it answers;
    else on a private head of this command's own (free ports, its own temp dir) that ends with it, even
    when the command is SIGKILLed. Ctrl-C or SIGTERM stops the job (and the private head)."""
    address = _ray_address(args)
    private = address is None
    try:
        with chunk_job.interrupts():
            gpus = run.spec.core_settings.logical_gpus  # a private head on a CPU host: logical GPUs for the spec
            with local_head.guarded(address) if address else stack.private_ray_head(say=_say, num_gpus=gpus) as where:
                jobs = RayJobs(where.address)
                _say(f"run {run.name}: training to step {args.to_step} as a Ray job on {where.address}")
                sub_id = chunk_job.local_submission_id(run)
                state = chunk_job.run_attached(
                    jobs,
                    sub_id,
                    lambda: chunk_job.submit_chunk(jobs, run, args.to_step, sub_id, not args.offline),
                    watch=where.watch_job,
                    stop_wait_s=run.spec.ray.stop_grace_seconds + STOP_MARGIN_S,
                )
                _record_job_times(jobs, run, state.submission_id, args.to_step)
    except KeyboardInterrupt as e:
        print(
            f"relay: interrupted ({e if isinstance(e, chunk_job.Interrupted) else 'Ctrl-C'}): "
            f"{'the private Ray head is stopped; ' if private else ''}the next `relay train` resumes run "
            f"{run.name} from its latest checkpoint",
            file=sys.stderr,
        )
        return chunk_job.exit_code(e)
    if state.status != "SUCCEEDED":
        what, code = chunk_job.failure(state)
        print(f"relay: Ray job {state.submission_id} of run {run.name} {what} (its log is above)", file=sys.stderr)
        cause = failure_cause.classify(
            state.status,
            state.message,
            exit_code=state.exit_code,
            step=failure_cause.step_of_failure(run.dir, state.submission_id),
            oom_kills=failure_cause.oom_kills_since_start(run.dir, state.submission_id),
        )
        failure_cause.record_failure(
            run.dir, cause, chunk=chunk_job.chunk_index(run.spec, args.to_step), attempt=state.submission_id
        )
        print("relay: " + cause.report().replace("\n", "\nrelay: "), file=sys.stderr)
        return code
    latest = latest_valid_step(run.dir)
    if latest is None or latest < args.to_step:
        print(
            f"relay: Ray job {state.submission_id} succeeded, but run {run.name}'s latest valid checkpoint is step "
            f"{latest or 0}, not {args.to_step}",
            file=sys.stderr,
        )
        return 1
    print(f"run {run.name}: Ray job {state.submission_id} succeeded; checkpoint {layout.step_dir(run.dir, latest)}")
    return 0


def _record_job_times(jobs: RayJobs, run: Run, sub_id: str, to_step: int) -> None:
    """The job's start and end as Ray recorded them, for the goodput ledger; never fails the command."""
    try:
        record_job_times(run.dir, jobs.get(sub_id), chunk=chunk_job.chunk_index(run.spec, to_step))
    except (OSError, RelayError) as e:
        print(f"relay: the times of Ray job {sub_id} were not recorded ({e})", file=sys.stderr)


def cmd_model_tiny(args) -> int:
    maker = next(k for k in KINDS.values() if k.tiny_model)  # a CPU stand-in, asked for by name
    folder = maker.make_tiny_model(Path(args.dir))
    print(f"tiny model (Qwen2, byte-level tokenizer with a chat template; no download) written to {folder}")
    return 0


def add_commands(sub) -> None:
    s = sub.add_parser("plan", help="print a spec's chunk plan and what a run has done")
    s.add_argument("spec")
    s.add_argument("--run", help="training run name (default: the spec's name)")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("spec", help="spec commands")
    ss = s.add_subparsers(dest="spec_command", required=True)
    c = ss.add_parser("check", help="validate a spec, its data and its checkpoint dir")
    c.add_argument("spec")
    c.add_argument("-v", "--verbose", action="store_true", help="list the resume-critical settings")
    c.set_defaults(func=cmd_spec_check)

    s = sub.add_parser(
        "train",
        help="train a run to --to-step, resuming from the latest: in this process (no Airflow, "
        "no Ray), or, for a trainer kind whose chunks run as Ray jobs, as one Ray job, the DAG's, its log here",
    )
    s.add_argument("spec")
    s.add_argument("--to-step", type=int, required=True)
    s.add_argument("--checkpoint-dir", help="the run's checkpoint folder (default: <spec checkpoint_dir>/<run>)")
    s.add_argument("--run", help="training run name (default: the spec's name)")
    s.add_argument(
        "--offline",
        action="store_true",
        help="never look at S3: no restore, no check of the published run; the local folder is the only source",
    )
    s.add_argument(
        "--fresh-start",
        action="store_true",
        help="start the run again from step 0: the old run is moved aside (locally and in S3), never "
        "deleted; a run that has checkpoints also needs --confirm NAME; refused while a trainer or Ray "
        "job of the run still runs",
    )
    s.add_argument("--confirm", metavar="NAME", help="the run's name, confirming --fresh-start")
    s.add_argument(
        "--ray-address",
        help="a kind whose chunks run as Ray jobs: the Ray dashboard to run the job on (default: RAY_ADDRESS, else the "
        "local stack's head if it answers, else a private head of this command's "
        "own that ends with it)",
    )
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("model", help="model commands")
    ms = s.add_subparsers(dest="model_command", required=True)
    c = ms.add_parser(
        "tiny",
        help="write a tiny verl-ready model (a 2-layer Qwen2 and a byte-level tokenizer with a "
        "chat template) into a new folder, with no download: the same bytes every time",
    )
    c.add_argument("dir", type=_new_folder)
    c.set_defaults(func=cmd_model_tiny)
