"""What a Ray cluster holds now, read from its head's dashboard as `ray list nodes` and `ray status` read it: every
node (alive or dead, with its labels and total resources) from the state API, and what is in use on each live node
from the autoscaler's load report. Plain HTTP (sync for the CLI and the train task, async for the triggerer): no
`ray` import, no driver attached to the cluster.

A node's free CPUs and GPUs are its totals less what its placement groups and tasks hold; verl places its workers
in placement groups, so a job that ended has given its GPUs back once its groups are removed (a few seconds).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from relay.common.errors import RayJobError
from relay.spec.kinds import WorldOption

NODES_PATH = "/api/v0/nodes?limit=1000&detail=1"
GROUPS_PATH = "/api/v0/placement_groups?limit=1000&detail=1"
STATUS_PATH = "/api/cluster_status"
NODE_LABEL = "relay.io/node"  # a node's name in Relay's words (the local stack sets it; a team's nodes may)


@dataclass(frozen=True)
class Node:
    """A node of the cluster: its name (the relay.io/node label, "head", or its id's start), whether it is alive,
    its total and free CPUs and GPUs, and when it ended (a dead node; epoch seconds)."""

    node_id: str
    name: str
    alive: bool
    is_head: bool
    cpus: float
    gpus: float
    cpus_free: float
    gpus_free: float
    ended_at: float | None = None

    def line(self) -> str:
        """The node in `relay stack status`'s words."""
        state = "alive" if self.alive else "dead"
        free = f", {self.gpus_free:g} GPU free" if self.alive and self.gpus else ""
        return f"{self.name:<10} {state:<5} {self.cpus:g} CPU, {self.gpus:g} GPU{free}  (node {self.node_id[:12]})"


def parse(nodes_answer: dict, status_answer: dict | None) -> list[Node]:
    """The nodes from the state API's answer and the load report's (None: nothing known in use); the head first."""
    rows = nodes_answer["data"]["result"]["result"]
    usage: dict[str, dict] = {}
    if status_answer is not None:
        report = ((status_answer.get("data") or {}).get("clusterStatus") or {}).get("loadMetricsReport") or {}
        usage = report.get("usageByNode") or {}
    out = []
    for row in rows:
        labels = row.get("labels") or {}
        head = bool(row.get("is_head_node"))
        name = "head" if head else labels.get(NODE_LABEL) or row["node_id"][:12]
        total = row.get("resources_total") or {}
        used = usage.get(row["node_id"]) or {}
        cpus, gpus = float(total.get("CPU", 0)), float(total.get("GPU", 0))
        used_cpus = float((used.get("CPU") or [0])[0])
        used_gpus = float((used.get("GPU") or [0])[0])
        alive = row.get("state") == "ALIVE"
        ended = (row.get("end_time_ms") or 0) / 1000 or None
        out.append(
            Node(
                row["node_id"],
                name,
                alive,
                head,
                cpus,
                gpus,
                max(0.0, cpus - used_cpus) if alive else 0.0,
                max(0.0, gpus - used_gpus) if alive else 0.0,
                None if alive else ended,
            )
        )
    return sorted(out, key=lambda n: (not n.is_head, n.name, not n.alive))


def nodes(address: str, timeout_s: float = 10) -> list[Node]:
    """The cluster's nodes now (the dashboard at `address`)."""
    return parse(_get(address, NODES_PATH, timeout_s), _get(address, STATUS_PATH, timeout_s))


async def nodes_async(address: str, timeout_s: float = 10) -> list[Node]:
    """nodes(), for the triggerer's event loop."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        got = []
        for path in (NODES_PATH, STATUS_PATH):
            async with s.get(f"{address.rstrip('/')}{path}") as r:
                if r.status >= 400:
                    raise RayJobError(f"Ray dashboard GET {path}: HTTP {r.status}: {(await r.text())[:300]}")
                got.append(await r.json(content_type=None))
    return parse(got[0], got[1])


def fits(groups: Sequence[tuple[float, float]], found: list[Node], *, free: bool = True) -> bool:
    """Whether placement groups of (CPUs, GPUs), each packed on one node, fit on the live nodes' free resources (or
    their totals: `free` False), placed largest first as Ray's scheduler would find room for them."""
    room = [[n.cpus_free, n.gpus_free] if free else [n.cpus, n.gpus] for n in found if n.alive]
    for cpus, gpus in sorted(groups, key=lambda g: (-g[1], -g[0])):
        spot = next((r for r in room if r[0] >= cpus and r[1] >= gpus), None)
        if spot is None:
            return False
        spot[0] -= cpus
        spot[1] -= gpus
    return True


def pick(options: Sequence[WorldOption], found: list[Node], *, free: bool = True) -> WorldOption | None:
    """The largest world size whose placement groups fit on the cluster now (options come largest first); None: not
    even the smallest."""
    return next((o for o in options if fits(o.groups, found, free=free)), None)


async def job_nodes_async(address: str, job_id: str, timeout_s: float = 10) -> set[str]:
    """The nodes the placement groups of Ray job `job_id` are on now (verl places its workers in them)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
        async with s.get(f"{address.rstrip('/')}{GROUPS_PATH}") as r:
            if r.status >= 400:
                raise RayJobError(f"Ray dashboard GET {GROUPS_PATH}: HTTP {r.status}: {(await r.text())[:300]}")
            answer = await r.json(content_type=None)
    return placed_on(answer, job_id)


def placed_on(groups_answer: dict, job_id: str) -> set[str]:
    """The nodes of the bundles of job `job_id`'s placement groups, from the state API's answer."""
    rows = groups_answer["data"]["result"]["result"]
    return {
        b["node_id"] for g in rows if g.get("creator_job_id") == job_id for b in g.get("bundles") or [] if b.get("node_id")
    }


def lost_since(found: list[Node], since: float) -> list[Node]:
    """The nodes that died at or after `since` (epoch seconds): a job that ran then lost them."""
    return [n for n in found if not n.alive and n.ended_at is not None and n.ended_at >= since]


def _get(address: str, path: str, timeout_s: float) -> dict:
    url = f"{address.rstrip('/')}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            answer: dict = json.load(r)
            return answer
    except OSError as e:
        raise RayJobError(
            f"the Ray dashboard at {address} did not answer {path}: {e}",
            "check that the Ray head runs and its dashboard answers (relay doctor)",
        ) from e
