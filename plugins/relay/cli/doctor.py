"""`relay doctor`: the pre-resume checklist of a run."""

from __future__ import annotations

import json
import os
import sys

from relay.common.errors import RelayError
from relay.devstack import stack
from relay.insights import doctor
from relay.jobs.ray_jobs import RayJobs
from relay.runs.run import Run
from relay.s3.store import store_for_spec
from relay.spec.run_spec import load_spec


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


def add_commands(sub) -> None:
    s = sub.add_parser("doctor", help="the pre-resume checklist of a run: exit 0 safe to resume, 1 not, 2 usage")
    s.add_argument("spec")
    s.add_argument("--run", help="training run name (default: the spec's name)")
    s.add_argument("--ray-address", help="Ray dashboard (default: RAY_ADDRESS, else the local stack's)")
    s.add_argument("--offline", action="store_true", help="skip the S3 and Ray checks")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_doctor)
