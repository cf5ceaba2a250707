"""The kernel's OOM-kill count of every node of a Ray cluster: the evidence that a worker killed on another node
was killed for memory, which no message text is (Ray's message for a SIGKILLed worker lists the OOM killer as one
of "some common causes", beside `ray stop --force`).

Each alive node's count (`oom_kill` in /proc/vmstat) is read by a small task pinned to that node
(NodeAffinitySchedulingStrategy, not soft). A trainer that runs inside Ray records the counts as its chunk starts
(the `node_oom_census` event, read on a thread of its own); when its job fails in a way an OOM kill can explain,
the train task reads them again with a small Ray job of its own (`python -m relay.runs.node_oom`). A node whose
count rose while the job ran is the evidence; the failure record names it. RELAY_NODE_OOM_COUNTER names another
file in /proc/vmstat's format to read instead, on every node (a test's double of the counter, nothing else).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from relay.runs.failure_cause import oom_kill_count

COUNTER_ENV = "RELAY_NODE_OOM_COUNTER"
EVENT = "node_oom_census"  # events.jsonl: {chunk, attempt, node_oom_kills}, recorded as a chunk starts
MARKER = "RELAY_NODE_OOM_KILLS "
CENSUS_TIMEOUT_S = 20.0


def read_counter() -> int | None:
    """This node's kernel OOM-kill count; None where it cannot be read."""
    return oom_kill_count(Path(os.environ.get(COUNTER_ENV) or "/proc/vmstat"))


def census(timeout_s: float = CENSUS_TIMEOUT_S) -> dict[str, dict[str, Any]]:
    """{node id: {"ip", "oom_kill"}} of every alive node that answered within timeout_s, read by a task pinned to it.
    In a process connected to Ray; {} where Ray cannot be asked."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    read = ray.remote(num_cpus=0, max_retries=0)(read_counter)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    refs = {
        n["NodeID"]: read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes
    }
    ips = {n["NodeID"]: n.get("NodeManagerAddress") for n in nodes}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    out = {}
    for node, ref in refs.items():
        if ref in done and (count := ray.get(ref)) is not None:
            out[node] = {"ip": ips[node], "oom_kill": count}
    return out


def connected() -> bool:
    """Whether this process is connected to Ray already (without importing Ray where it is not imported)."""
    import sys

    ray = sys.modules.get("ray")
    try:
        return bool(ray is not None and ray.is_initialized())
    except Exception:  # noqa: BLE001
        return False


def census_if_connected() -> dict[str, dict[str, Any]] | None:
    """The census where this process is already connected to Ray (verl's trainer), else None: a trainer that is not
    pays no connection for it (its own host's count is in chunk_start's `oom_kills`)."""
    try:
        import ray

        return census() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - evidence for later, never a reason for a chunk to fail
        return None


def rises(before: dict[str, dict[str, Any]] | None, after: dict[str, dict[str, Any]] | None) -> list[str]:
    """The evidence: each node whose OOM-kill count rose between the two censuses, in words."""
    out = []
    for node, now in (after or {}).items():
        then = (before or {}).get(node)
        if then is not None and now["oom_kill"] > then["oom_kill"]:
            out.append(
                f"node {now.get('ip') or '?'} ({node[:12]}): the kernel's OOM killer ended "
                f"{now['oom_kill'] - then['oom_kill']} process(es) there while the job ran (oom_kill "
                f"{then['oom_kill']} -> {now['oom_kill']})"
            )
    return out


def census_job(jobs: Any, spec: Any, attempt: str, timeout_s: float = 120.0) -> dict[str, dict[str, Any]] | None:
    """The census, read by a small Ray job of its own on the run's cluster (the train task holds no Ray connection);
    None when it cannot be had in time. `jobs`: the cluster's RayJobs (relay.jobs.ray_jobs)."""
    sub_id = f"{attempt}-oom-census-{int(time.time())}"
    try:
        metadata = {"relay_spec": spec.name, "relay_role": "oom-census"}
        found: dict[str, dict[str, Any]] | None = jobs.module_report(
            spec, "relay.runs.node_oom", sub_id, metadata, MARKER, timeout_s
        )[1]
        return found
    except Exception:  # noqa: BLE001 - no evidence is what a census that cannot run gives
        return None


def evidence_since_start(run_dir: Path, attempt: str, jobs: Any, spec: Any) -> list[str]:
    """The nodes whose OOM-kill count rose since the attempt's last census (its `node_oom_census` event), in words; []
    when it recorded none (a trainer not connected to Ray: its host's own count is the evidence) or no count rose."""
    from relay.runs.metrics import read_events

    start = next(
        (e for e in reversed(read_events(run_dir)) if e.get("attempt") == attempt and e.get("node_oom_kills")),
        None,
    )
    if not start:
        return []
    return rises(start["node_oom_kills"], census_job(jobs, spec, attempt))


def main() -> int:
    """`python -m relay.runs.node_oom`, a Ray job: print the census on one marked line."""
    import ray

    ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
    print(MARKER + json.dumps(census()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
