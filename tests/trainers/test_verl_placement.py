"""verl's resource pools against the cluster's nodes, before verl waits for them forever (placement.py)."""

from __future__ import annotations

import pytest

from relay.trainers.verl_ppo import placement
from relay.trainers.verl_ppo.placement import PlacementError

CPU_HEAD = {"CPU": 2.0, "memory": 8e9, "node:127.0.0.1": 1.0}  # a small head without GPUs


def verl_pool_manager(n_gpus_per_node: int, nnodes: int = 1):
    """verl's own ResourcePoolManager, as its v1 trainer builds it (trainer_base._init_resource_pool_mgr)."""
    from verl.single_controller.ray import ResourcePoolManager

    return ResourcePoolManager(resource_pool_spec={"global_pool": [n_gpus_per_node] * nnodes}, mapping={})


def test_a_cpu_head_without_gpus_is_refused_at_once_with_the_resources_named():
    m = verl_pool_manager(1)
    assert m.max_colocate_count == 3, "verl's default: 3 CPUs per worker bundle"
    with pytest.raises(PlacementError) as e:
        placement.check(m.resource_pool_spec, m.max_colocate_count, "GPU", [CPU_HEAD])
    assert "pool 'global_pool' needs one node with CPU 3, GPU 1" in e.value.what
    assert "its nodes have: CPU 2" in e.value.what
    assert "--num-gpus" in e.value.fix and "forever" in e.value.fix


def test_logical_gpus_and_one_cpu_per_worker_fit_a_small_cpu_head():
    head = {**CPU_HEAD, "GPU": 2.0}  # a head started with --num-gpus=2: logical GPUs, no device behind them
    placement.check({"global_pool": [2]}, 1, "GPU", [head])
    with pytest.raises(PlacementError, match="CPU 3, GPU 1"):
        placement.check({"global_pool": [1]}, 3, "GPU", [head])  # verl's default colocate count does not


def test_a_nodes_workers_must_fit_on_one_node_not_across_the_cluster():
    two = [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 1.0}]
    placement.check({"global_pool": [1, 1]}, 3, "GPU", two)  # one worker on each node
    with pytest.raises(PlacementError, match="needs one node with CPU 6, GPU 2"):
        placement.check({"global_pool": [2]}, 3, "GPU", two)  # two GPUs in total, but not on one node
    with pytest.raises(PlacementError, match="pool 'reward_pool'"):
        placement.check({"global_pool": [1], "reward_pool": [1]}, 3, "NPU", two)


def test_the_chunk_trainer_checks_before_verl_creates_its_pools(monkeypatch):
    """verl's _setup builds the pool manager, then creates the pools (and waits on them); Relay's trainer
    checks in between."""
    import inspect

    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from relay.trainers.verl_ppo.chunk_trainer import RelayChunkTrainer

    setup = inspect.getsource(PPOTrainerSync._setup)
    assert setup.index("self._init_resource_pool_mgr()") < setup.index("create_resource_pool()"), "verl's order"
    cls = RelayChunkTrainer

    def verls_own(self):  # what verl's _init_resource_pool_mgr leaves behind, without a config to read
        self.resource_pool_manager = verl_pool_manager(1)

    monkeypatch.setattr(PPOTrainerSync, "_init_resource_pool_mgr", verls_own)
    monkeypatch.setattr(placement, "ray_nodes", lambda: [CPU_HEAD])
    trainer = object.__new__(cls)
    with pytest.raises(PlacementError, match="pool 'global_pool' needs one node with CPU 3, GPU 1"):
        trainer._init_resource_pool_mgr()


@pytest.mark.services
def test_the_local_stacks_ray_head_holds_the_cpu_paths_worker(ray_address):
    """`relay stack up`'s head (the tests' too) advertises logical GPUs on a host without NVIDIA GPUs, so
    verl's pool of one worker at one CPU per bundle fits it; a bundle of more CPUs than the head has (verl's
    default of 3, on the tests' head of 2) does not."""
    import json
    import urllib.request

    from relay.devstack import stack

    with urllib.request.urlopen(f"{ray_address}/api/v0/nodes", timeout=30) as r:
        nodes = [n["resources_total"] for n in json.load(r)["data"]["result"]["result"] if n["state"] == "ALIVE"]
    if stack.logical_gpus() is not None:
        assert max(n.get("GPU", 0) for n in nodes) >= stack.LOGICAL_GPUS
    placement.check({"global_pool": [1]}, 1, "GPU", nodes)
    too_many = int(max(n.get("CPU", 0) for n in nodes)) + 1
    with pytest.raises(PlacementError, match=f"CPU {too_many}, GPU 1"):
        placement.check({"global_pool": [1]}, too_many, "GPU", nodes)


def test_separate_async_needs_the_training_and_rollout_pools_on_the_cluster_at_once():
    """The rollout's own workers (2 CPUs each, verl's standalone replica) are placed after the training pool: a head
    with one logical GPU holds either pool, never both, and is refused before verl waits."""
    one_gpu, two_gpus = {"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 2.0}
    placement.check_separate_rollout({"global_pool": [1]}, 1, [1], "GPU", [two_gpus])
    with pytest.raises(PlacementError) as e:
        placement.check_separate_rollout({"global_pool": [1]}, 1, [1], "GPU", [one_gpu])
    assert "need CPU 3, GPU 2 together; this Ray cluster has CPU 8, GPU 1" in e.value.what
    assert "--num-gpus" in e.value.fix and "rollout_n_gpus_per_node" in e.value.fix
    with pytest.raises(PlacementError, match="pool 'rollout_pool' needs one node with CPU 2, GPU 1"):
        placement.check_separate_rollout({"global_pool": [1]}, 1, [1], "GPU", [{"CPU": 1.0, "GPU": 4.0}])
