"""`relay checkpoint ...`: validate, publish, restore, reshard, list and inspect a run's checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

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
from relay.ops import checkpoint_folder as folder


def cmd_checkpoint_validate(args) -> int:
    run_dir = Path(args.dir)
    if args.quarantine:
        admission = folder.gate(run_dir, args.step)
        print(json.dumps(admission.to_dict(), indent=2) if args.json else admission.explain())
        return 0 if admission.ok else 1
    smoke_spec = None
    if args.smoke:
        source = args.spec or folder.spec_source(run_dir)
        if not source:
            print(
                f"--smoke needs the run's spec (its model): {args.dir} has no run record naming it; give --spec SPEC",
                file=sys.stderr,
            )
            return 2
        smoke_spec = _spec(source, check_environment=False)
    report = folder.validate(run_dir, args.step, quick=args.quick, smoke_spec=smoke_spec)
    print(report.to_json() if args.json else report.summary())
    return 0 if report.ok else 1


def cmd_checkpoint_publish(args) -> int:
    try:
        done = folder.publish(Path(args.dir), args.step, _store(args.uri, args), run=args.run)
    except folder.NoStep as e:
        print(e, file=sys.stderr)
        return 2
    if done.result is None:
        print(done.admission.explain(), file=sys.stderr)
        return 1
    print(done.describe())
    return 0


def cmd_checkpoint_restore(args) -> int:
    run_dir = Path(args.dir)
    restored = folder.restore(_store(args.uri), run_dir, run=args.run, step=args.step, force=args.force)
    if restored is None:
        print(f"no valid published checkpoint of run {args.run or run_dir.name} under {args.uri}", file=sys.stderr)
        return 1
    print(f"restored step {restored[0]} from {restored[1]} into {run_dir}; tracker -> {restored[0]}")
    return 0


def cmd_checkpoint_reshard(args) -> int:
    out = Path(args.out) if args.out else None
    done = folder.reshard(Path(args.dir), args.world_size, step=args.step, out=out)
    print(json.dumps(done.to_dict(), indent=2) if args.json else f"{done.result.explain()}\n{done.admission.explain()}")
    return 0 if done.admission.ok else 1


def cmd_checkpoint_ls(args) -> int:
    rows = folder.published(_store(args.uri), args.run)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
    else:
        for r in rows:
            state = "published" if r.published else "INCOMPLETE (no manifest)"
            print(f"{r.run:<24} step {r.step:>7}  {state:<24} {r.bytes or '':>12} {'latest' if r.latest else '':<6} {r.uri}")
    return 0


def cmd_checkpoint_inspect(args) -> int:
    try:
        result = folder.inspect(args.source, args.step, _store)
    except folder.NotARun as e:
        print(e, file=sys.stderr)
        return 2
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
