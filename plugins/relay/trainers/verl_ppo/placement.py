"""Whether verl's resource pools can ever be placed on this Ray cluster, asked before verl waits for them.

verl builds one placement group per node of each resource pool (`RayResourcePool.get_placement_groups`
in verl/single_controller/ray/base.py): as many bundles as the pool has workers on that node, each
`{"CPU": max_colocate_count, <accelerator>: 1}`, packed onto one node (STRICT_PACK). It then waits on
`pg.ready()` with no timeout. verl's own check before that (`ResourcePoolManager._check_resource_available`)
counts the cluster's free GPUs only, so a bundle that fits on no node (a 2-CPU head and verl's default
of 3 CPUs per bundle; a CPU node without logical GPUs) makes the chunk wait forever, silently.

Relay asks first, against every node's total resources: a placement group that no node can hold now
will never be placed, and the chunk fails at once with the resources named. (One that only waits for
busy resources is bounded by the chunk's start-up limit, like any start-up.) An autoscaling cluster that
would add such a node on demand is refused too, as verl's own check already refuses one whose GPUs are
not up yet: start the nodes before the chunk.
"""

from __future__ import annotations

from relay.common.errors import RelayError
from relay.trainers.verl_ppo.settings import VERL_ROLLOUT_CPUS_PER_GPU


class PlacementError(RelayError):
    """A verl resource pool needs more on one node than any node of the cluster has."""

    retry_helps = True


def placement_groups(
    pool_spec: dict[str, list[int]], max_colocate_count: int, accelerator: str
) -> list[tuple[str, dict[str, float]]]:
    """(pool name, what one node must hold) for each placement group verl will create."""
    return [
        (pool, {"CPU": float(max_colocate_count * workers), accelerator: float(workers)})
        for pool, per_node in pool_spec.items()
        for workers in per_node
    ]


def unplaceable(groups: list[tuple[str, dict[str, float]]], nodes: list[dict[str, float]]) -> list[str]:
    """The groups that fit on no node's total resources, said in words."""
    out = []
    for pool, need in groups:
        if not any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes):
            out.append(f"pool {pool!r} needs one node with {_resources(need)}")
    return out


def check(pool_spec: dict[str, list[int]], max_colocate_count: int, accelerator: str, nodes: list[dict[str, float]]) -> None:
    """Raise PlacementError when some placement group verl will wait for can never be placed."""
    missing = unplaceable(placement_groups(pool_spec, max_colocate_count, accelerator), nodes)
    if not missing:
        return
    have = "; ".join(_resources({k: v for k, v in n.items() if k in ("CPU", accelerator)}) for n in nodes) or "none"
    raise PlacementError(
        f"verl's workers cannot be placed on this Ray cluster: {', '.join(missing)} (verl packs each node's "
        f"workers onto one node, {max_colocate_count} CPU(s) and 1 {accelerator} per worker); its nodes have: "
        f"{have}",
        "give the cluster such a node (on a CPU node: start the head with --num-gpus=N for N logical GPUs, "
        "and enough --num-cpus), or ask for fewer workers per node (trainer.n_gpus_per_node); verl would "
        "otherwise wait for them forever",
    )


def _resources(r: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(r.items()))


def ray_nodes() -> list[dict[str, float]]:
    """Every live node's total resources, from the Ray cluster this process is connected to."""
    import ray

    return [dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")]


# verl's ResourcePoolManager for a standalone rollout replica (verl/workers/rollout/replica.py, init_standalone)
STANDALONE_COLOCATE_COUNT = VERL_ROLLOUT_CPUS_PER_GPU


def check_separate_rollout(
    train_pools: dict[str, list[int]],
    max_colocate_count: int,
    rollout_per_node: list[int],
    accelerator: str,
    nodes: list[dict[str, float]],
) -> None:
    """separate_async: verl places the rollout's own workers after the training pool, one placement group per
    replica with verl's 2 CPUs per worker (RolloutReplica.init_standalone); the cluster must hold both at once."""
    rollout = {"rollout_pool": rollout_per_node}
    check(rollout, STANDALONE_COLOCATE_COUNT, accelerator, nodes)
    groups = placement_groups(train_pools, max_colocate_count, accelerator) + placement_groups(
        rollout, STANDALONE_COLOCATE_COUNT, accelerator
    )
    need = {k: sum(g.get(k, 0.0) for _, g in groups) for k in ("CPU", accelerator)}
    have = {k: sum(n.get(k, 0.0) for n in nodes) for k in need}
    if all(have[k] >= v for k, v in need.items()):
        return
    raise PlacementError(
        f"verl's training workers and the rollout's own workers (separate_async) need {_resources(need)} together; "
        f"this Ray cluster has {_resources(have)}",
        "add nodes or logical GPUs (on a CPU node: start the head with --num-gpus=N), or give the rollout fewer GPUs "
        "(trainer.settings.rollout_n_gpus_per_node); verl would otherwise wait for them forever",
    )
