"""`relay doctor`: the pre-resume checklist of a run."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

from relay.common.errors import RelayError
from relay.devstack import stack
from relay.insights import doctor
from relay.jobs.ray_jobs import RayJobs
from relay.runs.run import Run
from relay.s3.store import store_for_spec
from relay.spec.kinds import KINDS
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
    findings = doctor.diagnose(run, store=store, jobs=jobs, contract_report=contract_report(spec, jobs))
    if args.json:
        print(
            json.dumps(
                {"run": run.name, "safe": all(f.ok for f in findings), "checks": [f.to_dict() for f in findings]}, indent=2
            )
        )
    else:
        print(doctor.report(findings, run))
    return 0 if all(f.ok for f in findings) else 1


CONTRACT_JOB_TIMEOUT_S = 300  # the contract's job on the cluster: an interpreter that imports the library


def contract_report(spec, jobs: RayJobs | None) -> Callable[[bool], tuple[str, dict[str, Any]]] | None:
    """How doctor checks the trainer kind's library contract (verl_ppo: relay.trainers.verl_ppo.verl_contract): in a
    Ray job on the cluster, where the chunks will run (`jobs`), else in this host's library (--offline). None for a
    kind without one."""
    contract = KINDS[spec.trainer.kind].library_contract_module()
    if contract is None:
        return None

    def here(cpu: bool) -> tuple[str, dict[str, Any]]:
        return "this host's", contract.report(cpu=cpu)

    def on_cluster(cpu: bool) -> tuple[str, dict[str, Any]]:
        assert jobs is not None
        return "the cluster's", _contract_on_cluster(spec, jobs, contract, cpu)

    return here if jobs is None else on_cluster


def _contract_on_cluster(spec, jobs: RayJobs, contract, cpu: bool) -> dict[str, Any]:
    """The contract's report, from a Ray job of its own (`python -m MODULE --json [--cpu]`)."""
    module = f"{contract.__name__} --json" + (" --cpu" if cpu else "")
    what = f"the {contract.LIBRARY} contract check"
    sub_id = f"relay-{contract.LIBRARY}-contract-{uuid.uuid4().hex[:12]}"
    metadata = {"relay_spec": spec.name, "relay_check": f"{contract.LIBRARY}_contract"}
    try:
        status, found, logs = jobs.module_report(spec, module, sub_id, metadata, contract.MARK, CONTRACT_JOB_TIMEOUT_S)
    except RelayError:
        raise  # the Jobs API's own error (a head that is not up), with its fix
    except Exception as e:  # noqa: BLE001 - any failure to reach the Jobs API
        raise RelayError(
            f"cannot run {what} on the cluster: {e}", "start the Ray head, or run with --offline", retry_helps=True
        ) from None
    if status is None:
        raise RelayError(
            f"{what} ({sub_id}) did not finish in {CONTRACT_JOB_TIMEOUT_S} s on the cluster",
            "check that the cluster has room for a one-CPU job, then run `relay doctor` again",
            retry_helps=True,
        )
    if found is None:
        tail = " | ".join(logs.strip().splitlines()[-3:])
        raise RelayError(
            f"{what} ({sub_id}) ended {status} without a report: {tail}",
            f"install {contract.LIBRARY} in the cluster image as Relay pins it; read the job's log for the import error",
            retry_helps=False,
        )
    return found


def add_commands(sub) -> None:
    s = sub.add_parser("doctor", help="the pre-resume checklist of a run: exit 0 safe to resume, 1 not, 2 usage")
    s.add_argument("spec")
    s.add_argument("--run", help="training run name (default: the spec's name)")
    s.add_argument("--ray-address", help="Ray dashboard (default: RAY_ADDRESS, else the local stack's)")
    s.add_argument("--offline", action="store_true", help="skip the S3 and Ray checks")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_doctor)
