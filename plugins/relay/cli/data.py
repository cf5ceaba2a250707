"""`relay data ...`: training data's quality checks, freeze and diff."""

from __future__ import annotations

import json

from relay.cli.shared import PARQUET, _path, _s3_uri, _store, _upload_options
from relay.ops import data_files


def cmd_data_check(args) -> int:
    report = data_files.check(args.parquet, min_rows=args.min_rows, suites=args.suite or [])
    print(report.to_json() if args.json else report.summary())
    return 0 if report.ok else 1


def cmd_data_freeze(args) -> int:
    print(json.dumps(data_files.freeze(args.parquet, _store(args.uri, args)), indent=2))
    return 0


def cmd_data_diff(args) -> int:
    d = data_files.compare(args.a, args.b)
    print(d.summary())
    return 0 if d.identical else 1


def add_commands(sub) -> None:
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
