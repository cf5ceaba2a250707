"""`relay checkpoint ...`: validate, publish, restore, reshard, list and inspect a run's checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from relay.checkpoints import preview
from relay.checkpoints.gate import admit_dir
from relay.checkpoints.validate import validate_checkpoint
from relay.cli.shared import (
    RUN_FOLDER,
    _checkpoints,
    _new_folder,
    _s3_uri,
    _s3_uri_or,
    _spec,
    _store,
    _upload_options,
    _world_size,
)
from relay.runs import layout
from relay.runs.folder import RunFolder
from relay.runs.lease import take_for_operator
from relay.runs.record import folder_incarnation
from relay.s3 import history
from relay.s3.restore import restore
from relay.s3.store import parse_uri


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
    # For the incarnation the folder holds now: a fresh start meanwhile takes back what this command wrote.
    folder = RunFolder(args.run or run_dir.name, run_dir, folder_incarnation(run_dir))
    result = store.publish(folder, step)
    history.publish(store, folder)
    print(
        f"published {result.uri}: {len(result.uploaded)} files uploaded ({result.bytes_uploaded} bytes), "
        f"{len(result.skipped)} already there, {result.aborted_uploads} stale uploads aborted, "
        f"{result.seconds:.1f}s; latest {'-> ' + str(step) if result.latest_moved else 'unchanged'}"
    )
    return 0


def cmd_checkpoint_restore(args) -> int:
    run_dir = Path(args.dir)
    token = take_for_operator(run_dir, "relay checkpoint restore", force=args.force)
    restored = restore(_store(args.uri), RunFolder(args.run or run_dir.name, run_dir), step=args.step, token=token)
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


def add_commands(sub) -> None:
    s = sub.add_parser("checkpoint", help="checkpoint commands")
    cs = s.add_subparsers(dest="checkpoint_command", required=True)
    c = cs.add_parser("validate", help="validate a run's checkpoint (default: the one the tracker names)")
    c.add_argument("dir", type=_checkpoints(RUN_FOLDER), help=RUN_FOLDER)
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
    c.add_argument("dir", type=_checkpoints(RUN_FOLDER), help=RUN_FOLDER)
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
    c.add_argument(
        "--force",
        action="store_true",
        help="restore even while a trainer of the run is alive on this host: it is fenced out (its next save is refused)",
    )
    c.set_defaults(func=cmd_checkpoint_restore)
    c = cs.add_parser(
        "reshard",
        help="write a valid checkpoint of verl's FSDP at another world size (number of GPUs): "
        "in place, the original kept in .relay/resharded/, or into --out",
    )
    c.add_argument("dir", type=_checkpoints(RUN_FOLDER), help=RUN_FOLDER)
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
        type=_s3_uri_or(_checkpoints("a run folder, a global_step_N folder or an s3:// URI")),
        help="a run folder, a global_step_N folder, or s3://BUCKET/PREFIX/RUN[/global_step_N]",
    )
    c.add_argument("--step", type=int, help="default: the tracker's (the published latest for S3)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_checkpoint_inspect)
