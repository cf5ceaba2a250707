"""`relay stack up --ray-nodes 2`: a Ray cluster of a head and two worker nodes on this host, as a team starts one
on its hosts (each node its own raylet, ports, temp dir, logical GPUs and label). GPU work is placed on the worker
nodes; a worker node is lost alone (its raylet and processes killed, never `ray stop`), `relay stack up` starts it
again, and `relay stack down` stops this stack's nodes and no other Ray of the host.

A stack of its own (its folder and ports), never the test session's head."""

from __future__ import annotations

import shutil
import socket
import time

import pytest

from relay.devstack import stack
from relay.jobs.local_head import NODE_PORT_OPTIONS
from relay.jobs.ray_jobs import RayJobs
from support.helpers import relay_cli
from support.polling import wait_for
from support.ports import free_ports

pytestmark = pytest.mark.services

GPU_TASK = (
    "import ray; ray.init(); "
    "where = ray.remote(num_gpus=1)(lambda: ray.get_runtime_context().get_node_id()); "
    "print('GPU_TASK_ON', ray.get(where.remote()))"
)


def _node_port_base(nodes: int) -> int:
    """A RELAY_RAY_NODE_PORT_BASE whose nodes' raylet ports are all free now."""
    for base in range(14000, 24000, stack.NODE_PORT_BLOCK * nodes):  # below the OS's ephemeral ports
        wanted = [base + (n * stack.NODE_PORT_BLOCK) + i for n in range(nodes) for i in range(len(NODE_PORT_OPTIONS))]
        try:
            held = []
            for port in wanted:
                s = socket.socket()
                held.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise AssertionError("no free block of ports for the worker nodes")


@pytest.fixture
def own_stack(tmp_path, monkeypatch, s3_server, ray_address):
    """This test's stack: its folder, its head's ports and its nodes' (S3 is the session's: it answers already)."""
    env = {"RELAY_STACK_DIR": str(tmp_path / "stack"), "RELAY_RAY_NODE_PORT_BASE": str(_node_port_base(2))}
    head = [key for key in stack.RAY_HEAD_PORTS.values() if "WORKER_PORT" not in key]
    env.update(zip(head, map(str, free_ports(len(head))), strict=True))
    env.update(RELAY_RAY_MIN_WORKER_PORT="0", RELAY_RAY_MAX_WORKER_PORT="0")  # the head's workers: ports the OS picks
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield env
    relay_cli("stack", "down", env=env, timeout=120)
    for node in range(3):  # the nodes' temp dirs under /tmp, named after this stack's folder
        shutil.rmtree(stack.ray_temp_dir(node), ignore_errors=True)


def test_the_local_stack_runs_worker_nodes_that_are_lost_alone_and_start_again(own_stack, ray_address):
    env = own_stack
    up = relay_cli("stack", "up", "--no-airflow", "--ray-nodes", "2", "--ray-cpus", "2", env=env, timeout=300)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    nodes = {n.name: n for n in stack.ray_nodes()}
    assert sorted(nodes) == ["head", "worker-1", "worker-2"] and all(n.alive for n in nodes.values()), nodes
    assert (nodes["head"].gpus, nodes["worker-1"].gpus, nodes["worker-2"].gpus) == (0, 1, 1), "GPUs on the workers"
    status = relay_cli("stack", "status", env=env)
    assert status.returncode == 0 and "worker-2   alive 4 CPU, 1 GPU" in status.stdout, status.stdout

    jobs = RayJobs(stack.ray_address())
    sub_id = jobs.client.submit_job(entrypoint=f'python -c "{GPU_TASK}"')
    wait_for(lambda: str(jobs.client.get_job_status(sub_id)) in ("SUCCEEDED", "FAILED"), 120, "the GPU task's job")
    logs = jobs.client.get_job_logs(sub_id)
    (placed,) = [line.split()[1] for line in logs.splitlines() if line.startswith("GPU_TASK_ON ")]
    assert placed in (nodes["worker-1"].node_id, nodes["worker-2"].node_id), "GPU work runs on a worker node"

    lost = nodes["worker-1"]
    assert stack.ray_node_lose(1) > 0
    t0 = time.time()
    wait_for(
        lambda: not next(n for n in stack.ray_nodes() if n.node_id == lost.node_id).alive,
        180,
        "the head to declare worker-1 dead",
    )
    dead_after = time.time() - t0
    alive = {n.name for n in stack.ray_nodes() if n.alive}
    assert alive == {"head", "worker-2"}, f"only worker-1 was lost ({dead_after:.0f}s): {alive}"

    again = relay_cli("stack", "up", "--no-airflow", "--ray-nodes", "2", env=env, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    back = [n for n in stack.ray_nodes() if n.name == "worker-1" and n.alive]
    assert len(back) == 1 and back[0].node_id != lost.node_id, "worker-1 started again, a new node"

    down = relay_cli("stack", "down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr[-3000:]
    assert not stack.ray_running() and not any(stack.ray_node_running(n) for n in (1, 2))
    assert stack._http_ok(f"{ray_address}/api/version"), "the session's head, another Ray of this host, still runs"
