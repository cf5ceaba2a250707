"""An elastic world size (verl's nnodes as [min, max]), the decisions without a cluster: which sizes a spec allows
and why others are refused, what fits on a cluster's nodes (read from answers of a real Ray 2.60 dashboard's
shape), when a chunk waits for nodes and when it goes on, and a lost node as a failure's cause. The same sizing on
real Ray nodes that die: tests/deploy/test_stack_nodes.py; through the DAG with verl: tests/airflow/test_verl_dag.py."""

from __future__ import annotations

import copy
import re

import pytest
import yaml

from relay.common.errors import SpecError
from relay.jobs import cluster
from relay.ops import elastic
from relay.runs import failure_cause as fc
from relay.runs.metrics import record_event
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from relay.trainers.verl_ppo.settings import VerlPPOSettings
from support.verl_jobs import SPEC

NODES_ANSWER = {
    "data": {
        "result": {
            "result": [
                {
                    "node_id": "h" * 56,
                    "is_head_node": True,
                    "state": "ALIVE",
                    "resources_total": {"CPU": 8.0},
                    "labels": {"relay.io/role": "head"},
                    "end_time_ms": 0,
                },
                {
                    "node_id": "a" * 56,
                    "is_head_node": False,
                    "state": "ALIVE",
                    "resources_total": {"CPU": 4.0, "GPU": 1.0},
                    "labels": {"relay.io/node": "worker-1"},
                    "end_time_ms": 0,
                },
                {
                    "node_id": "b" * 56,
                    "is_head_node": False,
                    "state": "ALIVE",
                    "resources_total": {"CPU": 4.0, "GPU": 1.0},
                    "labels": {"relay.io/node": "worker-2"},
                    "end_time_ms": 0,
                },
            ]
        }
    }
}


def status_answer(used: dict[str, dict[str, list[float]]]) -> dict:
    """The load report's shape: usageByNode[node][resource] = [used, total]."""
    return {"data": {"clusterStatus": {"loadMetricsReport": {"usageByNode": used}}}}


def nodes(*, dead: tuple[str, ...] = (), busy: tuple[str, ...] = (), ended_ms: int = 0) -> list[cluster.Node]:
    answer = copy.deepcopy(NODES_ANSWER)
    for row in answer["data"]["result"]["result"]:
        if row["labels"].get("relay.io/node") in dead:
            row["state"], row["end_time_ms"] = "DEAD", ended_ms
    used = {("a" if name == "worker-1" else "b") * 56: {"GPU": [1.0, 1.0], "CPU": [3.0, 4.0]} for name in busy}
    return cluster.parse(answer, status_answer(used))


def settings(**kw) -> VerlPPOSettings:
    base = dict(model_path="/m", nnodes=[1, 2], n_gpus_per_node=1, train_batch_size=4, ppo_mini_batch_size=2)
    return VerlPPOSettings(**{**base, "rollout_n": 2, "tensor_model_parallel_size": 1, **kw})


def test_a_range_of_nodes_allows_the_sizes_that_split_the_batch_the_largest_first():
    s = settings(nnodes=[1, 4], ppo_mini_batch_size=4, rollout_n=1)
    assert [o.world_size for o in s.world_options()] == [4, 2, 1], "3 ranks cannot split 4 responses"
    assert s.refused_world_sizes() == ["3: 4 responses a step in mini-batches of 4 do not split over 3 ranks"]
    assert s.world_size == 4 and s.world_size_text() == "1..4" and s.elastic
    two = s.at(2)
    assert (two.nnodes, two.n_gpus_per_node, two.world_size, two.elastic) == (2, 1, 2, False)
    with pytest.raises(ValueError, match="world size 3 is not one of the spec's: 4, 2, 1"):
        s.at(3)
    assert s.world_options()[0].groups == ((3.0, 1.0),) * 4, "verl: 3 CPUs and a GPU per worker, a group per node"
    separate = settings(trainer_mode="separate_async", parameter_sync_step=2, device="cpu", rollout_name="hf")
    assert separate.world_options()[0].groups[-1] == (2.0, 1.0), "the rollout's own replica beside the training pool"
    fixed = settings(nnodes=2)
    assert not fixed.elastic and fixed.at(None) is fixed and fixed.core().world_options == ()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"nnodes": [3, 3], "rollout_n": 1}, "no world size in nnodes [3, 3] x n_gpus_per_node 1 runs this batch: 3:"),
        ({"nnodes": [2, 1]}, "a range [min, max] with 1 <= min <= max (got [2, 1])"),
        ({"nnodes": [0, 2]}, "a range [min, max] with 1 <= min <= max (got [0, 2])"),
    ],
)
def test_a_range_that_allows_no_world_size_is_refused_with_why(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        settings(**kw)


def write_elastic_spec(tmp_path, **changes):
    d = yaml.safe_load(SPEC.read_text())
    d["trainer"]["settings"]["nnodes"] = [1, 2]
    d["checkpoints"]["on_world_size_change"] = "reshard"
    d["checkpoint_dir"] = str(tmp_path / "ckpt")
    for key, value in changes.items():
        section, _, leaf = key.rpartition(".")
        target = d
        for part in section.split(".") if section else []:
            target = target.setdefault(part, {})
        target[leaf] = value
    path = tmp_path / "elastic.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    return path


def test_an_elastic_spec_reshards_runs_chunked_and_records_its_range(tmp_path):
    spec = load_spec(write_elastic_spec(tmp_path), check_environment=False)
    assert [o.world_size for o in spec.core_settings.world_options] == [2, 1]
    from relay.trainers.verl_ppo.trainer import resolved_settings

    assert resolved_settings(spec)["resolved.world_size"] == "1..2", "the settings guard compares the range"
    with pytest.raises(SpecError, match="on_world_size_change") as refused:
        load_spec(write_elastic_spec(tmp_path, **{"checkpoints.on_world_size_change": "refuse"}), check_environment=False)
    assert "set checkpoints.on_world_size_change: reshard" in str(refused.value)
    with pytest.raises(SpecError, match="supervised mode trains the whole run in one job"):
        load_spec(write_elastic_spec(tmp_path, **{"trainer.settings.mode": "supervised"}), check_environment=False)


def test_the_largest_size_whose_groups_fit_on_free_nodes_is_picked():
    options = settings().world_options()
    assert cluster.pick(options, nodes()).world_size == 2
    assert cluster.pick(options, nodes(dead=("worker-1",))).world_size == 1
    assert cluster.pick(options, nodes(busy=("worker-2",))).world_size == 1, "another job holds worker-2's GPU"
    assert cluster.pick(options, nodes(busy=("worker-2",)), free=False).world_size == 2, "its totals would hold 2"
    assert cluster.pick(options, nodes(dead=("worker-1", "worker-2"))) is None, "the head has no GPU"
    crowded = nodes()
    assert not cluster.fits([(5.0, 1.0)], crowded), "a worker node has 4 CPUs: 5 do not fit on one node"
    line = nodes(busy=("worker-1",))[1].line()
    assert line.startswith("worker-1   alive 4 CPU, 1 GPU, 0 GPU free"), line


def elastic_run(tmp_path, wait_minutes: float = 5) -> Run:
    spec = load_spec(
        write_elastic_spec(tmp_path, **{"elastic.wait_for_nodes_minutes": wait_minutes}), check_environment=False
    )
    run = Run.of(spec, "r")
    run.dir.mkdir(parents=True)
    return run


def lose_a_node(run: Run, at: float) -> None:
    """A world-size-2 job's chunk_start, then its node_lost failure at `at`, in the run's events."""
    record_event(run.dir, "chunk_start", attempt="job-1", chunk=1, world_size=2, time=_iso(at - 60))
    record_event(run.dir, fc.EVENT, attempt="job-1", chunk=1, cause=fc.NODE_LOST, time=_iso(at))


def _iso(t: float) -> str:
    from relay.common.timestamps import event_time

    return event_time(t)


def test_after_a_lost_node_the_retry_waits_for_the_lost_size_then_goes_on_with_what_is_left(tmp_path, monkeypatch):
    run = elastic_run(tmp_path, wait_minutes=5)
    monkeypatch.setattr(elastic, "SETTLE_S", 0.0)
    t0 = 1_800_000_000.0
    lose_a_node(run, t0)
    assert elastic.unsettled_loss(run) == (pytest.approx(t0, abs=0.01), 2)
    monkeypatch.setattr(cluster, "nodes", lambda address: nodes(dead=("worker-1",)))
    with pytest.raises(elastic.WaitForNodes) as waiting:
        elastic.size(run, "http://ray", None, chunk=1, now=t0 + 60)
    assert not waiting.value.below_minimum and waiting.value.until == pytest.approx(t0 + 300, abs=0.01)
    assert waiting.value.groups == [[3.0, 1.0], [3.0, 1.0]], "it waits for the world size it lost"
    assert "a node was lost under its world-size-2 job" in waiting.value.what
    assert "worker-2: 1 of 1 GPU and 4 of 4 CPU free" in waiting.value.what

    sized = elastic.size(run, "http://ray", None, chunk=1, now=t0 + 301)  # no checkpoint yet: nothing to reshard
    assert (sized.world_size, sized.previous, sized.changed) == (1, None, False)
    assert "below the spec's largest, 2" in sized.why
    assert elastic.unsettled_loss(run) is None, "a size was chosen after the loss: later chunks do not wait"

    monkeypatch.setattr(cluster, "nodes", lambda address: nodes(dead=("worker-1", "worker-2")))
    with pytest.raises(elastic.WaitForNodes) as below:
        elastic.size(run, "http://ray", None, chunk=2)
    assert below.value.below_minimum and below.value.until is None and below.value.groups == [[3.0, 1.0]]
    assert "holds less than the run's minimum, world size 1" in below.value.what


def test_the_loss_is_not_waited_for_when_the_cluster_still_holds_the_size(tmp_path, monkeypatch):
    run = elastic_run(tmp_path)
    lose_a_node(run, 1_800_000_000.0)
    monkeypatch.setattr(cluster, "nodes", lambda address: nodes())  # the node came back already
    assert elastic.size(run, "http://ray", None, chunk=1, now=1_800_000_010.0).world_size == 2


def test_a_warm_job_is_refused_when_the_cluster_could_hold_a_larger_size(tmp_path, monkeypatch):
    from relay.jobs.ray_jobs import JobState

    run = elastic_run(tmp_path)
    larger = elastic.grow(run, "http://ray")
    job = JobState("job-1", "RUNNING", "", {"relay_world_size": "1"}, None, None, None)
    monkeypatch.setattr(cluster, "nodes", lambda address: nodes(busy=("worker-1",)))  # the warm job's own GPU
    assert larger(job) == "the cluster holds world size 2 (2 node(s) x 1 GPU(s)) now, more than the job's world size 1"
    monkeypatch.setattr(cluster, "nodes", lambda address: nodes(busy=("worker-1",), dead=("worker-2",)))
    assert larger(job) is None, "no node for a second worker: the warm job goes on"
    at_two = JobState("job-2", "RUNNING", "", {"relay_world_size": "2"}, None, None, None)
    assert larger(at_two) is None, "already the largest"


def test_a_lost_node_is_the_cause_whatever_its_peers_said():
    gloo = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4321"
    cause = fc.classify("FAILED", gloo, gloo, 1, lost_nodes=["Ray node worker-1 (aaaaaaaaaaaa, 1 GPU) died at T"])
    assert cause.cause == fc.NODE_LOST and cause.evidence[0].startswith("Ray node worker-1"), cause.report()
    assert fc.classify("FAILED", gloo, gloo, 1).cause == fc.COLLECTIVE_TIMEOUT, "without the evidence: a collective"
    died = "ray.exceptions.ActorDiedError: The actor died because its node has died. Node Id: aaaa"
    assert fc.classify("FAILED", died, died, 1).cause == fc.NODE_LOST
    assert fc.policy(fc.Cause(fc.NODE_LOST)) == fc.RETRY


def test_the_report_names_the_world_size_of_each_stretch_of_steps_and_shades_the_smaller(tmp_path):
    from relay.insights import report
    from relay.runs.metrics import MetricsLog

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    for attempt, size in (("j1", 2), ("j2", 1), ("j3", 2)):
        record_event(run_dir, "chunk_start", attempt=attempt, chunk=1, world_size=size)
    log = MetricsLog(run_dir)
    for step, attempt in ((1, "j1"), (2, "j1"), (3, "j2"), (4, "j2"), (5, "j3")):
        log.append({"step": step, "attempt": attempt, "loss": 1.0 / step, "lr": 1e-6})
    page = report.build(run_dir)
    assert page.world_size_bands() == [(1, 2, 2), (3, 4, 1), (5, 5, 2)]
    assert "world size: 2 (steps 1-2), 1 (steps 3-4), 2 (steps 5-5)" in page.summary()
    assert len(page.plot_png()) > 10_000


def test_a_job_the_trigger_stopped_for_a_dead_node_or_a_stall_under_one_is_node_lost():
    said = "Ray node worker-1 (aaaaaaaaaaaa) of job j died; job stopped (it ended STOPPED)"
    assert fc.classify("NODE_LOST", said).cause == fc.NODE_LOST
    stalled = "no new step for 300s; job j stopped (it ended STOPPED)"
    assert fc.classify("STALLED", stalled).cause == fc.STALLED
    lost = fc.classify("STALLED", stalled, lost_nodes=["Ray node worker-1 (aaaa, 1 GPU) died at T while the job ran"])
    assert lost.cause == fc.NODE_LOST and lost.evidence[0].startswith("Ray node worker-1"), lost.report()


def test_the_nodes_of_a_jobs_placement_groups_are_read_from_the_state_api():
    answer = {
        "data": {
            "result": {
                "result": [
                    {"creator_job_id": "02000000", "bundles": [{"node_id": "a" * 56}, {"node_id": "b" * 56}]},
                    {"creator_job_id": "03000000", "bundles": [{"node_id": "c" * 56}]},
                    {"creator_job_id": "02000000", "bundles": [{"node_id": None}]},  # not placed yet
                ]
            }
        }
    }
    assert cluster.placed_on(answer, "02000000") == {"a" * 56, "b" * 56}


def test_a_size_made_of_more_nodes_or_of_more_gpus_each_trains_as_the_cluster_can_hold_it():
    s = settings(nnodes=[1, 2], n_gpus_per_node=[1, 2], ppo_mini_batch_size=4)
    twos = [(o.nnodes, o.gpus_per_node) for o in s.world_options() if o.world_size == 2]
    assert twos == [(1, 2), (2, 1)], "fewer nodes first"
    picked = cluster.pick(s.world_options(), nodes())  # two worker nodes of one GPU each: 2 x 1, not 1 x 2
    assert (picked.world_size, picked.nnodes, picked.gpus_per_node) == (2, 2, 1)
    chosen = s.at(picked.world_size, picked.nnodes)
    assert (chosen.nnodes, chosen.n_gpus_per_node) == (2, 1), "the job gets the nodes the pick fitted"
    assert (s.at(2).nnodes, s.at(2).n_gpus_per_node) == (1, 2)
