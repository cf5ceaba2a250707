"""`python -m relay ...`: the core, from a terminal.

Standard AWS environment variables configure S3 (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

from relay.checkpoints import preview
from relay.checkpoints.gate import admit_dir
from relay.checkpoints.validate import latest_step_or_problem, latest_valid_step, validate_checkpoint
from relay.common.errors import RelayError, StoreError, UsageError
from relay.data import quality
from relay.data.diff import diff
from relay.data.fingerprint import fingerprint
from relay.devstack import demo, stack
from relay.insights import doctor, report
from relay.insights.audit import audit
from relay.jobs import chunk_job, local_head
from relay.jobs.ray_jobs import STOP_MARGIN_S, RayJobs
from relay.preflight import attention
from relay.preflight.prepare import prepare_run
from relay.runs import failure_cause, layout
from relay.runs.folder import RunFolder
from relay.runs.phases import record_job_times
from relay.runs.run import Run
from relay.s3 import history
from relay.s3.restore import restore
from relay.s3.store import CheckpointStore, parse_uri, s3_client, store_for_spec, upload_args
from relay.spec.plan import ChunkPlan
from relay.spec.run_spec import load_spec
from relay.trainers.contract import ChunkRequest, run_chunk
from relay.trainers.quiet import quiet_known_noise
from relay.trainers.verl_ppo.tiny_model import make_tiny_model

EXIT_CODES = (
    "exit codes: 0 success; 1 a finding (a checkpoint, tracker or parquet file that exists but is corrupt, "
    "truncated, empty or unsafe; an audit that diverged; a resume that doctor finds unsafe; a command that "
    "failed); 2 usage (bad arguments, or a path that does not exist or is not what the command takes)"
)


FIX = "\n  What to do: "  # how a RelayError prints what to do, in a usage error too


class _Parser(argparse.ArgumentParser):
    """argparse, its usage errors said as Relay's errors are (what is wrong, then what to do), exit 2."""

    def error(self, message: str):
        what, _, fix = message.partition(FIX)
        self.exit(2, f"relay: {what}{FIX}{f'{fix} (`{self.prog} --help`)' if fix else f'see `{self.prog} --help`'}\n")


def _path(kind: str, what: str):
    """An argparse type: a path that exists and is a `kind` ("folder" or "file"), else a usage error naming it."""

    def check(value: str) -> str:
        p = Path(value)
        if not p.exists():
            raise argparse.ArgumentTypeError(f"{value} does not exist{FIX}give {what}")
        if (kind == "folder") != p.is_dir():
            raise argparse.ArgumentTypeError(f"{value} is not a {kind}{FIX}give {what}")
        return value

    return check


def _s3_uri(value: str) -> str:
    """An argparse type: s3://BUCKET/PREFIX."""
    try:
        parse_uri(value)
    except RelayError as e:
        raise argparse.ArgumentTypeError(f"{e.what}{FIX}{e.fix}" if e.fix else e.what) from None
    return value


def _s3_uri_or(local):
    """An argparse type: an s3:// URI, or what `local` accepts."""
    return lambda value: _s3_uri(value) if value.startswith("s3://") else local(value)


def _new_folder(value: str) -> str:
    """An argparse type: a folder to write into, which may not exist yet but is not a file."""
    if Path(value).exists() and not Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"{value} is not a folder{FIX}give a folder to write into")
    return value


def _world_size(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{value}: a world size is a number of processes, at least 1{FIX}give "
            "the number of GPUs (processes) the next chunk trains on"
        )
    return n


RUN_FOLDER = "the run's checkpoint folder (<checkpoint_dir>/<run>, verl's default_local_dir)"
PARQUET = "a parquet file"


def _spec(path: str, check_environment: bool = True):
    return load_spec(path, check_environment=check_environment)


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
    found = attention.check(spec)
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


def _ray_address(args) -> str | None:
    """The Ray cluster a run's jobs live on: --ray-address, else RAY_ADDRESS, else the local stack's head when it
    answers."""
    return args.ray_address or os.environ.get("RAY_ADDRESS") or (stack.ray_address() if stack.ray_running() else None)


def _ray_jobs_if_running(args) -> RayJobs | None:
    address = _ray_address(args)
    return RayJobs(address) if address else None


def _train_as_ray_job(args, run: Run) -> int:
    """A trainer kind whose chunks run as Ray jobs (verl_ppo): the chunk as the DAG's Ray job, its log on
    stdout. On the cluster at --ray-address, else RAY_ADDRESS, else the local stack's head when it answers;
    else on a private head of this command's own (free ports, its own temp dir) that ends with it, even
    when the command is SIGKILLed. Ctrl-C or SIGTERM stops the job (and the private head)."""
    address = _ray_address(args)
    private = address is None
    try:
        with chunk_job.interrupts():
            with local_head.guarded(address) if address else stack.private_ray_head(say=_say) as where:
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


def _say(line: str) -> None:
    print(line, flush=True)


def cmd_checkpoint_validate(args) -> int:
    if args.quarantine:
        admission = admit_dir(Path(args.dir), args.step)
        print(json.dumps(admission.to_dict(), indent=2) if args.json else admission.explain())
        return 0 if admission.ok else 1
    smoke = None
    if args.smoke:
        from relay.preflight.admission import smoke_check
        from relay.runs.record import read_record

        source = args.spec or read_record(Path(args.dir)).get("spec_source")
        if not source:
            print(
                f"--smoke needs the run's spec (its model): {args.dir} has no run record naming it; give --spec SPEC",
                file=sys.stderr,
            )
            return 2
        spec = _spec(source, check_environment=False)
        smoke = smoke_check(spec.model_copy(update={"checkpoints": spec.checkpoints.model_copy(update={"smoke": True})}))
    # Every level but smoke by default: without the safe load and the numerics, a checkpoint with NaN weights,
    # or a pickle that would run code, would pass.
    report = validate_checkpoint(Path(args.dir), args.step, upto="integrity" if args.quick else "numerics", smoke=smoke)
    print(report.to_json() if args.json else report.summary())
    return 0 if report.ok else 1


def _store(uri: str, args=None):
    """A store on uri; an upload command's --sse, --kms-key-id and --acl go with every object it writes."""

    extra = upload_args(getattr(args, "sse", None), getattr(args, "kms_key_id", None), getattr(args, "acl", None))
    return CheckpointStore(s3_client(), uri, extra_args=extra)


def _upload_options(c) -> None:
    c.add_argument("--sse", choices=["AES256", "aws:kms"], help="ask S3 for server-side encryption of every object")
    c.add_argument("--kms-key-id", help="the KMS key of --sse aws:kms")
    c.add_argument("--acl", choices=["bucket-owner-full-control", "private"], help="canned ACL of every object")


def cmd_checkpoint_publish(args) -> int:
    run_dir = Path(args.dir)
    step = args.step or layout.read_tracker(run_dir)
    if step is None:
        print(f"{run_dir} has no tracker: give --step", file=sys.stderr)
        return 2
    admission = admit_dir(run_dir, step)  # only a checkpoint proven whole is published
    if not admission.ok:
        print(admission.explain(), file=sys.stderr)
        return 1
    store = _store(args.uri, args)
    result = store.publish(args.run or run_dir.name, run_dir, step)
    history.publish(store, RunFolder(args.run or run_dir.name, run_dir))
    print(
        f"published {result.uri}: {len(result.uploaded)} files uploaded ({result.bytes_uploaded} bytes), "
        f"{len(result.skipped)} already there, {result.aborted_uploads} stale uploads aborted, "
        f"{result.seconds:.1f}s; latest {'-> ' + str(step) if result.latest_moved else 'unchanged'}"
    )
    return 0


def cmd_checkpoint_restore(args) -> int:
    run_dir = Path(args.dir)
    restored = restore(_store(args.uri), args.run or run_dir.name, run_dir, step=args.step)
    if restored is None:
        print(f"no valid published checkpoint of run {args.run or run_dir.name} under {args.uri}", file=sys.stderr)
        return 1
    print(f"restored step {restored[0]} from {restored[1]} into {run_dir}; tracker -> {restored[0]}")
    return 0


def cmd_checkpoint_reshard(args) -> int:
    from relay.checkpoints.reshard import reshard

    run_dir = Path(args.dir)
    result = reshard(run_dir, args.world_size, step=args.step, out=Path(args.out) if args.out else None)
    # The gate on the new step, as on a trainer's save: every level; its manifest records the reshard.
    admission = admit_dir(Path(args.out) if args.out else run_dir, result.step)
    out = {**result.to_dict(), "valid": admission.ok, "validation": admission.explain()}
    print(json.dumps(out, indent=2) if args.json else f"{result.explain()}\n{admission.explain()}")
    return 0 if admission.ok else 1


def cmd_checkpoint_ls(args) -> int:
    store = _store(args.uri)
    runs = [args.run] if args.run else store.runs()
    rows = []
    for run in runs:
        latest = (store.latest(run) or {}).get("step")
        for step in store.steps(run):
            m = store.manifest(run, step)
            rows.append(
                {
                    "run": run,
                    "step": step,
                    "published": m is not None,
                    "latest": step == latest,
                    "bytes": m.total_bytes if m else None,
                    "files": len(m.files) if m else None,
                    "uri": store.step_uri(run, step),
                }
            )
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            state = "published" if r["published"] else "INCOMPLETE (no manifest)"
            print(
                f"{r['run']:<24} step {r['step']:>7}  {state:<24} {r['bytes'] or '':>12} "
                f"{'latest' if r['latest'] else '':<6} {r['uri']}"
            )
    return 0


def cmd_checkpoint_inspect(args) -> int:
    if args.source.startswith("s3://"):
        bucket, key = parse_uri(args.source)
        parts = key.rstrip("/").split("/")
        step = args.step
        if parts and parts[-1].startswith("global_step_"):
            step, parts = step or int(parts[-1].removeprefix("global_step_")), parts[:-1]
        if not parts or not parts[-1]:
            print("give s3://BUCKET/PREFIX/RUN[/global_step_N]", file=sys.stderr)
            return 2
        store = _store(f"s3://{bucket}/{'/'.join(parts[:-1])}")
        result = preview.inspect_uri(store, parts[-1], step)
    else:
        result = preview.inspect_dir(Path(args.source), args.step)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.summary())
    return 0 if result.checksums_ok is not False else 1


def cmd_doctor(args) -> int:
    try:
        spec = load_spec(args.spec, check_environment=False)
    except RelayError as e:
        print(f"relay: {e}", file=sys.stderr)
        return 2
    run = Run.of(spec, args.run)
    store = jobs = None
    if not args.offline:
        store = store_for_spec(spec) if spec.s3 is not None else None
        jobs = RayJobs(args.ray_address or os.environ.get("RAY_ADDRESS") or stack.ray_address())
    findings = doctor.diagnose(run, store=store, jobs=jobs)
    if args.json:
        print(
            json.dumps(
                {"run": run.name, "safe": all(f.ok for f in findings), "checks": [f.to_dict() for f in findings]}, indent=2
            )
        )
    else:
        print(doctor.report(findings, run))
    return 0 if all(f.ok for f in findings) else 1


def cmd_data_check(args) -> int:
    extra = [e for f in (args.suite or []) for e in quality.load_expectations(Path(f))]
    report = quality.check(args.parquet, min_rows=args.min_rows, extra=extra)
    print(report.to_json() if args.json else report.summary())
    return 0 if report.ok else 1


def cmd_data_freeze(args) -> int:
    fp = fingerprint(args.parquet)
    store = _store(args.uri, args)
    uri = store.put_file("/".join(p for p in (store.prefix, "data", f"{fp.sha256}.parquet") if p), Path(args.parquet))
    print(json.dumps({"sha256": fp.sha256, "size": fp.size, "rows": fp.rows, "frozen_uri": uri}, indent=2))
    return 0


def cmd_data_diff(args) -> int:
    d = diff(args.a, args.b)
    print(d.summary())
    return 0 if d.identical else 1


def cmd_report(args) -> int:
    if args.source.startswith("s3://"):
        with tempfile.TemporaryDirectory() as tmp:
            rep = report.from_s3(args.source, Path(tmp))
        out = Path(args.out or f"report-{rep.run}")
    else:
        rep = report.build(Path(args.source))
        out = Path(args.out) if args.out else report.default_out(Path(args.source))
    if args.json:  # the JSON alone on stdout; files only where --out asks for them
        if args.out:
            report.write(rep, out)
        print(json.dumps(rep.to_dict(), indent=2, default=str))
        return 0
    paths = report.write(rep, out)
    print(rep.summary())
    print(f"report: {paths['html']}\nplot:   {paths['png']}")
    return 0


def cmd_audit(args) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / layout.METRICS).is_file():
        raise UsageError(
            f"{run_dir} has no {layout.METRICS}: not a run folder, or nothing trained yet",
            "give the run's folder, <checkpoint_dir>/<run>",
        )
    tolerance = _spec(args.spec).audit.tolerance if args.spec else None
    result = audit(run_dir, tolerance)
    print(json.dumps(result.to_dict(), indent=2, default=str) if args.json else result.summary())
    return 0 if result.consistent else 1


def cmd_stack(args) -> int:
    if args.action == "up":
        info = stack.up(with_airflow=not args.no_airflow, db_url=args.db, ray_cpus=args.ray_cpus)
        for k, v in info.items():
            print(f"{k:>12}: {v}")
    elif args.action == "down":
        print("stopped: " + ", ".join(stack.down(wait_s=args.wait)))
    else:
        print(f"state folder: {stack.state_dir()}")
        print("running: " + (", ".join(stack.running_services()) or "nothing started by relay"))
    return 0


def cmd_model_tiny(args) -> int:
    folder = make_tiny_model(Path(args.dir))
    print(f"tiny model (Qwen2, byte-level tokenizer with a chat template; no download) written to {folder}")
    return 0


def cmd_demo(args) -> int:
    return demo.run(keep_running=args.keep_running, provoke_resume=not args.no_kill)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    # `relay ...` (the console script) or `python -m relay ...`: usage lines name what was typed
    prog = prog or ("python -m relay" if sys.argv[0].endswith("__main__.py") else "relay")
    p = _Parser(prog=prog, description=__doc__, epilog=EXIT_CODES)
    sub = p.add_subparsers(dest="command", required=True)

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
        "no Ray; tiny_grpo), or as one Ray job, the DAG's, its log here (verl_ppo)",
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
        help="verl_ppo: the Ray dashboard to run the job on (default: RAY_ADDRESS, else the "
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

    s = sub.add_parser("checkpoint", help="checkpoint commands")
    cs = s.add_subparsers(dest="checkpoint_command", required=True)
    c = cs.add_parser("validate", help="validate a run's checkpoint (default: the one the tracker names)")
    c.add_argument("dir", type=_path("folder", RUN_FOLDER), help=RUN_FOLDER)
    c.add_argument("--step", type=int)
    c.add_argument(
        "--quick",
        action="store_true",
        help="structure, consistency and integrity only (default: every level but smoke: also load every "
        ".pt safely and check numerics)",
    )
    c.add_argument(
        "--smoke",
        action="store_true",
        help="also load the weights into the run's model and run one forward pass (the spec comes from the "
        "run record, or --spec)",
    )
    c.add_argument("--spec", help="the run's spec, for --smoke")
    c.add_argument("--deep", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    c.add_argument(
        "--quarantine",
        action="store_true",
        help="act like the DAG's gate: every level; write the manifest if valid, else quarantine it and "
        "point the tracker at the newest valid checkpoint",
    )
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_checkpoint_validate)
    c = cs.add_parser("publish", help="validate, then publish a checkpoint to s3://BUCKET/PREFIX/<run>/")
    c.add_argument("dir", type=_path("folder", RUN_FOLDER), help=RUN_FOLDER)
    c.add_argument("uri", type=_s3_uri, help="s3://BUCKET/PREFIX")
    c.add_argument("--step", type=int, help="default: the tracker's")
    c.add_argument("--run", help="run name (default: the folder's name)")
    _upload_options(c)
    c.set_defaults(func=cmd_checkpoint_publish)
    c = cs.add_parser("restore", help="restore the newest valid published checkpoint into DIR")
    c.add_argument("uri", type=_s3_uri, help="s3://BUCKET/PREFIX")
    c.add_argument("dir", type=_new_folder)
    c.add_argument("--step", type=int, help="newest at or below this step")
    c.add_argument("--run", help="run name (default: DIR's name)")
    c.set_defaults(func=cmd_checkpoint_restore)
    c = cs.add_parser(
        "reshard",
        help="write a valid checkpoint of verl's FSDP at another world size (number of GPUs): "
        "in place, the original kept in .relay/resharded/, or into --out",
    )
    c.add_argument("dir", type=_path("folder", RUN_FOLDER), help=RUN_FOLDER)
    c.add_argument("--world-size", type=_world_size, required=True, help="the number of processes (GPUs) to resume on")
    c.add_argument("--step", type=int, help="default: the tracker's")
    c.add_argument("--out", help="write the resharded step into this run folder instead; the source is not touched")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_checkpoint_reshard)
    c = cs.add_parser("ls", help="list published checkpoints under s3://BUCKET/PREFIX")
    c.add_argument("uri", type=_s3_uri)
    c.add_argument("--run")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_checkpoint_ls)

    c = cs.add_parser(
        "inspect",
        help="what a resume would load: step, epoch, dataloader position, LR, RNG, "
        "parallelism, parameters, files and checksums (nothing is unpickled)",
    )
    c.add_argument(
        "source",
        type=_s3_uri_or(_path("folder", "a run folder, a global_step_N folder or an s3:// URI")),
        help="a run folder, a global_step_N folder, or s3://BUCKET/PREFIX/RUN[/global_step_N]",
    )
    c.add_argument("--step", type=int, help="default: the tracker's (the published latest for S3)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_checkpoint_inspect)

    s = sub.add_parser("doctor", help="the pre-resume checklist of a run: exit 0 safe to resume, 1 not, 2 usage")
    s.add_argument("spec")
    s.add_argument("--run", help="training run name (default: the spec's name)")
    s.add_argument("--ray-address", help="Ray dashboard (default: RAY_ADDRESS, else the local stack's)")
    s.add_argument("--offline", action="store_true", help="skip the S3 and Ray checks")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_doctor)

    s = sub.add_parser("data", help="training data: quality checks, freeze, diff")
    ds = s.add_subparsers(dest="data_command", required=True)
    c = ds.add_parser("check", help="run the verl RL data-quality suite (great-expectations) on a parquet file")
    c.add_argument("parquet", type=_path("file", PARQUET))
    c.add_argument("--suite", action="append", help="extra expectations file (YAML), repeatable")
    c.add_argument("--min-rows", type=int, default=1, help="fewest rows acceptable (a run uses train_batch_size)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_data_check)
    c = ds.add_parser("freeze", help="fingerprint a parquet file and upload it to s3://BUCKET/PREFIX/data/<sha256>")
    c.add_argument("parquet", type=_path("file", PARQUET))
    c.add_argument("uri", type=_s3_uri)
    _upload_options(c)
    c.set_defaults(func=cmd_data_freeze)
    c = ds.add_parser("diff", help="what changed from PARQUET_A to PARQUET_B (exit 0 when identical)")
    c.add_argument("a", type=_path("file", PARQUET))
    c.add_argument("b", type=_path("file", PARQUET))
    c.set_defaults(func=cmd_data_diff)

    s = sub.add_parser("report", help="a run's report: plots, chunk table, fingerprints (report.html + report.png)")
    s.add_argument(
        "source",
        type=_s3_uri_or(_path("folder", "a run folder or s3://BUCKET/PREFIX/RUN")),
        help="a run folder (<checkpoint_dir>/<run>) or s3://BUCKET/PREFIX/RUN",
    )
    s.add_argument("--out", help="output folder (default: <run>/.relay/report/; ./report-<run>/ for S3)")
    s.add_argument(
        "--json",
        action="store_true",
        help="the report as JSON on stdout and nothing else (goodput, chunks, audit, save interval); no files unless --out",
    )
    s.set_defaults(func=cmd_report)

    s = sub.add_parser(
        "audit",
        help="the replay audit: each step trained twice (after a resume) against its first "
        "try; exit 0 consistent, 1 diverged",
    )
    s.add_argument(
        "run_dir",
        type=_path("folder", "a run folder (<checkpoint_dir>/<run>)"),
        help="a run folder (<checkpoint_dir>/<run>)",
    )
    s.add_argument("--spec", help="the run's spec: its audit.tolerance (default: every metric exact)")
    s.add_argument("--json", action="store_true", help="the audit as JSON on stdout, and nothing else")
    s.set_defaults(func=cmd_audit)

    s = sub.add_parser("stack", help="the local stack: S3, Ray head and Airflow (ports: include/stack.env)")
    s.add_argument("action", choices=["up", "down", "status"])
    s.add_argument("--no-airflow", action="store_true", help="only the Ray head")
    s.add_argument("--db", help="Airflow metadata DB URL (default: SQLite in the stack's state folder)")
    s.add_argument(
        "--ray-cpus",
        type=int,
        metavar="N",
        help="up: logical CPUs the Ray head advertises (default: the cores, at least 8, as a verl chunk "
        "on CPUs needs); fewer runs fewer chunk jobs at once",
    )
    s.add_argument(
        "--wait",
        type=float,
        default=0,
        metavar="SECONDS",
        help="down: wait this long for unfinished DAG runs to end first; those still unfinished are "
        "marked failed with a note saying the stack was stopped under them (default 0)",
    )
    s.set_defaults(func=cmd_stack)

    s = sub.add_parser("demo", help="run the demo spec's DAG end to end on the local stack")
    s.add_argument("--keep-running", action="store_true", help="leave the stack up to explore the UI")
    s.add_argument("--no-kill", action="store_true", help="no crash drill: chunk 2's trainer is not killed to show a resume")
    s.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    quiet_known_noise()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RelayError as e:
        print(f"relay: {e}", file=sys.stderr)
        return e.exit_code
