"""`relay report` and `relay audit`: what a run did, and whether its steps trained again agree with their first try."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from relay.cli.shared import _path, _s3_uri_or, _spec
from relay.ops import run_history


def cmd_report(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        rep, default_out = run_history.build_report(args.source, Path(tmp))
    out = Path(args.out) if args.out else default_out
    if args.json:  # the JSON alone on stdout; files only where --out asks for them
        if args.out:
            run_history.write_report(rep, out)
        print(json.dumps(rep.to_dict(), indent=2, default=str))
        return 0
    paths = run_history.write_report(rep, out)
    print(rep.summary())
    print(f"report: {paths['html']}\nplot:   {paths['png']}")
    return 0


def cmd_audit(args) -> int:
    tolerance = _spec(args.spec).audit.tolerance if args.spec else None
    result = run_history.replay_audit(Path(args.run_dir), tolerance)
    print(json.dumps(result.to_dict(), indent=2, default=str) if args.json else result.summary())
    return 0 if result.consistent else 1


def add_commands(sub) -> None:
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
        "try, and for verl's async trainer every prompt trained once; exit 0 consistent, 1 diverged",
    )
    s.add_argument(
        "run_dir",
        type=_path("folder", "a run folder (<checkpoint_dir>/<run>)"),
        help="a run folder (<checkpoint_dir>/<run>)",
    )
    s.add_argument("--spec", help="the run's spec: its audit.tolerance (default: every metric exact)")
    s.add_argument("--json", action="store_true", help="the audit as JSON on stdout, and nothing else")
    s.set_defaults(func=cmd_audit)
