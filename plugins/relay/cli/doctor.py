"""`relay doctor`: the pre-resume checklist of a run."""

from __future__ import annotations

import json
import os

from relay.cli.shared import _spec
from relay.devstack import stack
from relay.ops import run_doctor


def cmd_doctor(args) -> int:
    spec = _spec(args.spec, check_environment=False)
    address = None if args.offline else args.ray_address or os.environ.get("RAY_ADDRESS") or stack.ray_address()
    run, findings = run_doctor.checklist(spec, args.run, ray_address=address)
    if args.json:
        print(
            json.dumps(
                {"run": run.name, "safe": all(f.ok for f in findings), "checks": [f.to_dict() for f in findings]}, indent=2
            )
        )
    else:
        print(run_doctor.report(findings, run))
    return 0 if all(f.ok for f in findings) else 1


def add_commands(sub) -> None:
    s = sub.add_parser("doctor", help="the pre-resume checklist of a run: exit 0 safe to resume, 1 not, 2 usage")
    s.add_argument("spec")
    s.add_argument("--run", help="training run name (default: the spec's name)")
    s.add_argument("--ray-address", help="Ray dashboard (default: RAY_ADDRESS, else the local stack's)")
    s.add_argument("--offline", action="store_true", help="skip the S3 and Ray checks")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_doctor)
