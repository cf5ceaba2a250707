"""`relay plan`, `relay spec check`, `relay train` (in this process, or as the DAG's Ray job) and
`relay model tiny`: a run, from its spec to its trained steps."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from relay.cli.shared import _new_folder, _ray_address, _ray_jobs_if_running, _say, _spec
from relay.common.errors import RelayError, StoreError
from relay.devstack import stack
from relay.ops import reshard_run, train_run
from relay.ops.runs import Run


def cmd_plan(args) -> int:
    spec = _spec(args.spec, check_environment=False)
    text, problem = train_run.plan(spec, args.run)
    if problem:
        print(f"warning: {problem}", file=sys.stderr)
    print(text)
    if spec.core_settings.world_options:  # elastic: the size the next chunk would take on the cluster now
        address = _ray_address(args)
        try:
            said = train_run.next_world_size(spec, args.run, address) if address else None
        except RelayError as e:
            said = f"the cluster at {address} did not say what it holds ({e.what})"
        print(said or "world size: no Ray cluster to ask (give --ray-address, or start the local stack)")
    return 0


def cmd_spec_check(args) -> int:
    checked = train_run.check_spec(_spec(args.spec))
    print("\n".join(checked.summary))
    if args.verbose:
        for k, v in sorted(checked.critical.items()):
            print(f"  {k} = {v!r}")
    if checked.warning:  # a warning: the spec is valid
        print(f"warning: {checked.warning}", file=sys.stderr)
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
    store = train_run.store_of(spec, offline=args.offline)
    try:
        state = train_run.prepare(
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
        # Before every `relay train`, so the one after a refused resume also finds the step it falls back to at the
        # new size.
        if (resharded := reshard_run.reshard_to_spec(run, store)) is not None:
            print(resharded.done)
            if resharded.warning:
                print(f"warning: {resharded.warning}", file=sys.stderr)
        if train_run.runs_as_job(spec):
            return _train_as_ray_job(args, run)
        result = train_run.train_here(run, args.to_step, offline=args.offline)
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


def _train_as_ray_job(args, run: Run) -> int:
    """A trainer kind whose chunks run as Ray jobs: the chunk as the DAG's Ray job, its log on stdout. On the
    cluster at --ray-address, else RAY_ADDRESS, else the local stack's head when it answers; else on a private head
    of this command's own (free ports, its own temp dir) that ends with it, even when the command is SIGKILLed.
    Ctrl-C or SIGTERM stops the job (and the private head)."""
    address = _ray_address(args)
    gpus = run.spec.core_settings.logical_gpus  # a private head on a CPU host: logical GPUs for the spec
    try:
        outcome = train_run.train_as_job(
            run,
            args.to_step,
            address=address,
            private_head=lambda: stack.private_ray_head(say=_say, num_gpus=gpus),
            offline=args.offline,
            say=_say,
            warn=lambda warning: print(f"relay: {warning}", file=sys.stderr),
        )
    except KeyboardInterrupt as e:
        what, code = train_run.interrupted(e)
        print(
            f"relay: interrupted ({what}): {'the private Ray head is stopped; ' if address is None else ''}the next "
            f"`relay train` resumes run {run.name} from its latest checkpoint",
            file=sys.stderr,
        )
        return code
    for line in outcome.errors:
        print(f"relay: {line}", file=sys.stderr)
    if outcome.said:
        print(outcome.said)
    return outcome.code


def cmd_model_tiny(args) -> int:
    folder = train_run.make_tiny_model(Path(args.dir))  # a CPU stand-in, asked for by name
    print(f"tiny model (Qwen2, byte-level tokenizer with a chat template; no download) written to {folder}")
    return 0


def add_commands(sub) -> None:
    s = sub.add_parser("plan", help="print a spec's chunk plan and what a run has done")
    s.add_argument("spec")
    s.add_argument("--run", help="training run name (default: the spec's name)")
    s.add_argument(
        "--ray-address",
        help="an elastic spec: the Ray dashboard asked what size the next chunk would take (default: RAY_ADDRESS, "
        "else the local stack's head when it answers)",
    )
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
