"""The pre-resume checklist of a run, as `relay doctor` runs it: every check the DAG itself makes
(relay.insights.doctor), against the cluster's Ray jobs and the run's S3 copy unless offline, and the trainer
kind's library contract checked where the chunks run (a Ray job on the cluster), or in this host's library offline.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from relay.common.errors import RelayError
from relay.insights import doctor
from relay.insights.doctor import Finding
from relay.jobs.ray_jobs import RayJobs
from relay.ops import elastic
from relay.runs.run import Run
from relay.s3.store import store_for_spec
from relay.spec.kinds import KINDS
from relay.spec.run_spec import RunSpec


def checklist(spec: RunSpec, run_name: str | None, *, ray_address: str | None) -> tuple[Run, list[Finding]]:
    """The run's checklist: with `ray_address`, its live jobs and the library contract on that cluster and its S3
    copy; without (offline), the local folder and this host's library only."""
    run = Run.of(spec, run_name)
    store = store_for_spec(spec) if ray_address is not None and spec.s3 is not None else None
    jobs = RayJobs(ray_address) if ray_address is not None else None
    findings = doctor.diagnose(run, store=store, jobs=jobs, contract_report=contract_report(spec, jobs))
    if ray_address is not None and spec.core_settings.world_options:
        findings.append(world_size(run, ray_address))
    return run, findings


def world_size(run: Run, address: str) -> Finding:
    """An elastic run: the world size its next chunk would train at on the cluster now, and why (a wait is a
    warning: the chunk would go on once the nodes are up)."""
    try:
        said = elastic.next_size(run, address) or ""
    except RelayError as e:
        return Finding("world size", False, f"the cluster did not say what it holds: {e.what}", e.fix or "")
    waits = said.startswith("the next chunk would wait")
    fix = "start worker nodes, or lower the minimum of trainer.settings.nnodes" if waits else ""
    return Finding("world size", True, said, fix, warning=waits)


def report(findings: list[Finding], run: Run) -> str:
    """The checklist as the command prints it: one line per check, and whether a resume is safe."""
    return doctor.report(findings, run)


CONTRACT_JOB_TIMEOUT_S = 300  # the contract's job on the cluster: an interpreter that imports the library


def contract_report(spec: RunSpec, jobs: RayJobs | None) -> Callable[[bool], tuple[str, dict[str, Any]]] | None:
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


def _contract_on_cluster(spec: RunSpec, jobs: RayJobs, contract: Any, cpu: bool) -> dict[str, Any]:
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
