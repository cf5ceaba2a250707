"""`relay stack up --ray-nodes 2`: a Ray cluster of a head and two worker nodes on this host, as a team starts one
on its hosts (each node its own raylet, ports, temp dir, logical GPUs and label). GPU work is placed on the worker
nodes; a worker node is lost alone (its raylet and processes killed, never `ray stop`), `relay stack up` starts it
again, and `relay stack down` stops this stack's nodes and no other Ray of the host.

On the same cluster, an elastic run (verl's spec at nnodes [1, 2]) with a checkpoint verl wrote at world size 2: the
sizing reads the nodes from the dashboard, the lost node is the failure's evidence (node_lost), the retry goes on at
world size 1 from the checkpoint resharded and admitted, a wait for nodes ends when the node is back, and the next
cold start grows back to 2.

A stack of its own (its folder and ports), never the test session's head."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

from relay.checkpoints import manifest
from relay.devstack import stack
from relay.jobs import cluster
from relay.jobs.ray_jobs import RayJobs
from relay.ops import elastic, follow_job
from relay.runs import failure_cause as fc
from relay.runs import layout
from relay.runs.metrics import MetricsLog, read_events, record_event
from relay.runs.run import Run
from support import verl_checkpoint
from support.helpers import relay_cli
from support.polling import wait_for
from support.private_stack import node_stack_env
from support.verl_jobs import spec_variant

pytestmark = pytest.mark.services

HOLD_GPUS = (
    "import ray, time; from ray.util.placement_group import placement_group; ray.init(); "
    "pg = placement_group([{'CPU': 1, 'GPU': 1}] * 2, strategy='STRICT_SPREAD'); ray.get(pg.ready()); "
    "print('HOLDING', flush=True); time.sleep(600)"
)
GPU_TASK = (
    "import ray; ray.init(); "
    "where = ray.remote(num_gpus=1)(lambda: ray.get_runtime_context().get_node_id()); "
    "print('GPU_TASK_ON', ray.get(where.remote()))"
)


@pytest.fixture
def own_stack(tmp_path, s3_server, ray_address):
    """This test's stack: its folder, its head's ports and its nodes' (S3 is the session's: it answers already)."""
    with node_stack_env(tmp_path / "stack", nodes=2) as env:
        yield env


@pytest.fixture
def elastic_run(tmp_path):
    """verl's CPU spec at nnodes [1, 2] (no wait for lost nodes), a run whose step 1 verl wrote at world size 2."""
    from relay.spec.run_spec import load_spec

    path = spec_variant(
        tmp_path / "elastic.yaml",
        tmp_path / "ckpt",
        {"nnodes": [1, 2], "n_gpus_per_node": 1},
        {"on_world_size_change": "reshard", "smoke": False},  # the written checkpoint has no tokenizer to smoke-test
    )
    run = Run.of(load_spec(path, check_environment=False), "r")
    verl_checkpoint.make_many([{"run_dir": run.dir, "world_size": 2, "fsdp": 2, "hidden": 24, "layers": 2, "vocab": 67}])
    MetricsLog(run.dir).append({"step": 1, "attempt": "job-0", "chunk": 1, "loss": 0.5})  # the step's row, as trained
    return run.spec.model_copy(update={"elastic": run.spec.elastic.model_copy(update={"wait_for_nodes_minutes": 0})})


@pytest.mark.fault
def test_the_local_stack_runs_worker_nodes_that_are_lost_alone_and_start_again(
    own_stack, ray_address, elastic_run, fault_row
):
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

    address = stack.ray_address()
    # the head's load report frees the GPU task's GPU a moment after its job ended
    wait_for(lambda: all(n.gpus_free == n.gpus for n in cluster.nodes(address) if n.alive), 60, "the GPU task's GPU freed")
    run = Run.of(elastic_run, "r")
    plan = relay_cli("plan", elastic_run.source, "--run", "r", "--ray-address", address)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "the next chunk would train at world size 2 of 1..2: the cluster holds world size 2" in plan.stdout, plan.stdout
    sized = elastic.size(run, address, None, chunk=1)
    assert (sized.world_size, sized.previous, sized.resharded) == (2, 2, None), sized
    record_event(run.dir, "chunk_start", attempt="job-1", chunk=2, world_size=2)

    # A job holding a GPU on each worker node (as verl's workers hold theirs), followed as a chunk's trigger follows it
    held = jobs.client.submit_job(entrypoint=f'python -c "{HOLD_GPUS}"')
    wait_for(lambda: (s := jobs.get(held)) is not None and s.job_id and "HOLDING" in jobs.logs(held), 120, "the hold")
    watch = follow_job.ChunkWatch(deadline=time.time() + 600, poll_seconds=1.0, stop_grace_s=10.0)
    follow = concurrent.futures.ThreadPoolExecutor(1)
    followed = follow.submit(asyncio.run, follow_job.chunk_job(address, held, watch, lambda _: None, lambda _: None))

    lost = nodes["worker-1"]
    assert stack.ray_node_lose(1) > 0
    t0 = time.time()
    wait_for(
        lambda: not next(n for n in stack.ray_nodes() if n.node_id == lost.node_id).alive,
        180,
        "the head to declare worker-1 dead",
    )
    dead_after = time.time() - t0
    ended = followed.result(timeout=120)
    follow.shutdown()
    assert ended.status == follow_job.NODE_LOST and "worker-1" in ended.message, ended
    assert fc.classify(ended.status, ended.message).cause == fc.NODE_LOST
    alive = {n.name for n in stack.ray_nodes() if n.alive}
    assert alive == {"head", "worker-2"}, f"only worker-1 was lost ({dead_after:.0f}s): {alive}"

    evidence = elastic.lost_nodes(address, run, "job-1")
    assert len(evidence) == 1 and evidence[0].startswith("Ray node worker-1 (") and "while the job ran" in evidence[0]
    cause = fc.classify("FAILED", "gloo: Connection closed by peer", exit_code=1, lost_nodes=evidence)
    assert cause.cause == fc.NODE_LOST, cause.report()
    fc.record_failure(run.dir, cause, chunk=2, attempt="job-1")
    shrunk = elastic.size(run, address, None, chunk=2)  # elastic.wait_for_nodes_minutes 0: at once
    assert (shrunk.world_size, shrunk.previous, shrunk.changed) == (1, 2, True), shrunk
    assert shrunk.resharded is not None and shrunk.resharded.result.to_world_size == 1
    m = manifest.read(layout.step_dir(run.dir, 1))
    assert m.world_size == 1 and m.resharded_from["world_size"] == 2, "admitted by the gate at the new size"
    assert "below the spec's largest, 2 (worker-2: 1 of 1 GPU and " in shrunk.why, shrunk.why

    two = [[3.0, 1.0], [3.0, 1.0]]
    waited = follow_job.capacity(address, two, time.time() + 1, 0.5)
    assert asyncio.run(waited).status == follow_job.WAITED, "one worker node cannot hold world size 2"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        back_soon = pool.submit(asyncio.run, follow_job.capacity(address, two, time.time() + 300, 1.0))
        again = relay_cli("stack", "up", "--no-airflow", "--ray-nodes", "2", env=env, timeout=300)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert back_soon.result(timeout=300).status == follow_job.CAPACITY, "the wait ends when the node is back"
    back = [n for n in stack.ray_nodes() if n.name == "worker-1" and n.alive]
    assert len(back) == 1 and back[0].node_id != lost.node_id, "worker-1 started again, a new node"
    grown = elastic.size(run, address, None, chunk=3)
    assert (grown.world_size, grown.previous, grown.changed) == (2, 1, True), grown
    assert manifest.read(layout.step_dir(run.dir, 1)).world_size == 2
    chosen = [(e["chunk"], e["world_size"], e["previous"]) for e in read_events(run.dir) if e["event"] == elastic.EVENT]
    assert chosen == [(1, 2, 2), (2, 1, 2), (3, 2, 1)], chosen
    fault_row(
        case="node-lost",
        layer="Ray cluster (a worker node of an elastic run)",
        fault="worker-1's raylet and processes SIGKILLed; started again later",
        action="classified node_lost from the head's dead-node record; the next size 1, its step resharded 2 -> 1 and "
        "admitted; a wait for size 2 ended when the node was back, and the next size 2 (step resharded 1 -> 2)",
        steps_lost=0,
        run_dir=run.dir,
    )

    down = relay_cli("stack", "down", env=env, timeout=120)
    assert down.returncode == 0, down.stderr[-3000:]
    assert not stack.ray_running() and not any(stack.ray_node_running(n) for n in (1, 2))
    assert stack._http_ok(f"{ray_address}/api/version"), "the session's head, another Ray of this host, still runs"
