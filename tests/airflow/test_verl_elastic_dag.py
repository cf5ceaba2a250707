"""An elastic verl run through its DAG on a cluster that loses a node and gets it back (verl's lane,
`./scripts/test.sh --verl`): include/runs/verl_tiny_cpu.yaml at nnodes [1, 2], one logical GPU per worker node, on a
stack of its own (`relay stack up --ray-nodes 2`: a head and two worker nodes, each its own raylet).

The run starts on a cluster whose worker nodes are both dead: chunk 1 waits below the minimum (deferred, one
`capacity` alert, nothing trained) until the nodes are started. Chunk 1 then trains at world size 2 and goes on warm
into chunk 2; after step 3 worker-1's raylet is killed with its processes (a dead host). The trigger stops the job
once the head declares the node dead, and the failure is `node_lost`; the retry goes on at world size 1 from step 2
resharded 2 -> 1 (admitted by the gate, republished, its certificate holding at the new size, as verl's workers
recompute it after the load). worker-1 is started again while the retry is held at the end of step 4, and chunk 3
refuses that job's warm chunk to start cold at world size 2, step 4 resharded 1 -> 2.
Against a run of the same spec that never changed size (`relay train` 0 -> 6 at world size 2 on the same cluster):
the same data order, LR and global batch at every step; the replay audit passes; nothing is quarantined; the report
shows the world size's band and the ledger the time below the largest size."""

from __future__ import annotations

import pytest
import yaml

from relay.alerts.ledger import AlertLedger
from relay.common.faultpoint import FAULT_ENV
from relay.devstack import stack
from relay.insights import goodput, report
from relay.insights.audit import audit
from relay.jobs import cluster
from relay.runs.metrics import SUPERSEDED, read_events, read_jsonl
from relay.spec.run_spec import load_spec
from support.helpers import read_metrics, relay_cli, start_dags_test
from support.polling import wait_for
from support.private_stack import node_stack_env
from support.verl_jobs import JOB_TIMEOUT, SPEC, dag_spec, relay_train, wait_for_step

pytestmark = [pytest.mark.services, pytest.mark.lane("verl")]

RUN = "elastic"


def elastic_source(path, nnodes, env: dict[str, str] | None = None) -> None:
    d = yaml.safe_load(SPEC.read_text())
    d.setdefault("ray", {}).setdefault("env_vars", {}).update(env or {})
    d["name"] = "verl_elastic"
    d["trainer"]["settings"].update(nnodes=nnodes, n_gpus_per_node=1)
    d["checkpoints"]["on_world_size_change"] = "reshard"
    d["elastic"] = {"wait_for_nodes_minutes": 0, "poll_seconds": 2}
    d["chunks"] = {"handoff": "warm"}
    path.write_text(yaml.safe_dump(d, sort_keys=False))


@pytest.mark.fault
def test_a_lost_node_shrinks_the_run_and_its_return_grows_it_back(airflow_home, s3_server, tmp_path, fault_row):
    source = tmp_path / "verl_elastic.yaml"
    held = tmp_path / "held-at-step-4"  # the first job to end step 4 (chunk 2's retry) waits there for worker-1
    elastic_source(source, [1, 2], {FAULT_ENV: "verl_step_end@4", "RELAY_FAULT_ONCE": str(held)})
    spec_path = dag_spec(source, airflow_home["runs"], "relay_verl_elastic")
    run_dir = load_spec(spec_path, check_environment=False).run_dir(RUN)
    with node_stack_env(tmp_path / "stack", nodes=2) as env:
        up = relay_cli("stack", "up", "--no-airflow", "--ray-nodes", "2", env=env, timeout=300)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        address = stack.ray_address()
        for node in (1, 2):  # below the minimum before the run starts: no worker node holds a GPU
            assert stack.ray_node_lose(node) > 0
        wait_for(lambda: not any(n.alive and n.gpus for n in cluster.nodes(address)), 180, "both nodes declared dead")
        dag = start_dags_test(
            airflow_home, "relay_verl_elastic", {"run": RUN}, env={"AIRFLOW_CONN_RELAY_VERL_ELASTIC": address}
        )
        try:
            waits = lambda: [e for e in AlertLedger(run_dir).entries() if e.get("kind") == "capacity"]  # noqa: E731
            wait_for(waits, 300, "chunk 1's capacity alert")
            assert not (run_dir / "metrics.jsonl").exists(), "nothing trains below the minimum"
            back = relay_cli("stack", "up", "--no-airflow", "--ray-nodes", "2", env=env, timeout=300)
            assert back.returncode == 0, back.stdout[-3000:] + back.stderr[-3000:]
            wait_for_step(run_dir, 3, set())  # chunk 1's job, gone on warm into chunk 2
            assert stack.ray_node_lose(1) > 0
            at_one = lambda: any(  # noqa: E731
                e["event"] == "chunk_start" and e.get("world_size") == 1 for e in read_events(run_dir)
            )
            wait_for(at_one, JOB_TIMEOUT, "chunk 2's retry at world size 1")
            wait_for(held.exists, JOB_TIMEOUT, "chunk 2's retry held at the end of step 4")
            again = relay_cli("stack", "up", "--no-airflow", "--ray-nodes", "2", env=env, timeout=300)
            assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
            both = lambda: sum(1 for n in cluster.nodes(address) if n.alive and n.gpus) == 2  # noqa: E731
            wait_for(both, 120, "worker-1 back")
            held.with_name(held.name + ".go").touch()  # before chunk 3's admission: it grows back to world size 2
            returncode, out = dag.wait(timeout=3 * JOB_TIMEOUT)
        finally:
            if dag.proc.poll() is None:
                dag.proc.kill()
        assert returncode == 0, out[-8000:]
        assert len(waits()) == 1, "one alert for the wait below the minimum"
        kinds = [e["kind"] for e in AlertLedger(run_dir).entries()]
        assert kinds.count("world_size") == 2 and kinds.count("resharded") == 2, kinds
        assert "the cluster holds them" in out, "the train task deferred until the nodes were up, then went on"

        straight_source = tmp_path / "straight.yaml"
        elastic_source(straight_source, 2)
        straight = tmp_path / "straight" / "run"
        log = tmp_path / "straight.log"
        straight_spec = tmp_path / "straight-spec.yaml"
        d = yaml.safe_load(straight_source.read_text())
        d["data"]["train_files"] = [str(SPEC.parent.parent.parent / f) for f in d["data"]["train_files"]]
        d["data"]["val_files"] = [str(SPEC.parent.parent.parent / f) for f in d["data"]["val_files"]]
        straight_spec.write_text(yaml.safe_dump(d, sort_keys=False))
        assert relay_train(straight, 6, address, log, spec=straight_spec).wait(timeout=JOB_TIMEOUT) == 0, log.read_text(
            errors="replace"
        )[-6000:]

    events = read_events(run_dir)
    failed = [e for e in events if e["event"] == "chunk_failed"]
    assert [e["cause"] for e in failed] == ["node_lost"], failed
    assert "Ray node worker-1" in failed[0]["evidence"][0], failed[0]
    sizes = [(e["chunk"], e["world_size"], e["previous"]) for e in events if e["event"] == "world_size"]
    assert sizes[0] == (1, 2, None) and (2, 1, 2) in sizes and sizes[-1] == (3, 2, 1), sizes
    starts = [(e["chunk"], e.get("world_size"), e.get("warm")) for e in events if e["event"] == "chunk_start"]
    assert starts[-1] == (3, 2, False), f"chunk 3 started cold at world size 2 (the warm job refused): {starts}"
    assert not any(e["event"] == "quarantine" for e in events), "nothing quarantined"
    certified = {(e["step"], e["certificate"]) for e in events if e["event"] == "resume_certificate"}
    assert {(2, "certified"), (4, "certified")} <= certified, f"each resharded step's certificate holds: {certified}"

    rows, base = read_metrics(run_dir), read_metrics(straight)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] == [r["step"] for r in base]
    for key in ("lr", "sample_indices"):  # the LR and the data order at every step
        assert [r[key] for r in rows] == [r[key] for r in base], key
    batch = load_spec(spec_path, check_environment=False).settings.train_batch_size
    assert all(len(r["sample_indices"]) == batch for r in rows), "the global batch at every world size"
    replay = audit(run_dir)
    assert replay.consistent and 3 in replay.across_world_sizes, replay.summary()

    ledger = goodput.ledger(run_dir)
    assert ledger is not None and ledger.largest_world_size == 2 and ledger.below_largest_s > 0, ledger.to_dict()
    page = report.build(run_dir)
    assert {size for *_, size in page.world_size_bands()} == {1, 2}, page.world_size_bands()
    assert "world size: 2 (steps 1-2), 1 (steps 3-4), 2 (steps 5-6)" in page.summary(), page.summary()
    retrained = [r["step"] for r in read_jsonl(run_dir / SUPERSEDED)]
    fault_row(
        case="node-lost-elastic-dag",
        layer="Ray cluster (a worker node under verl's ranks, through the DAG)",
        fault="worker-1's raylet and processes SIGKILLed after step 3 of chunk 2 (world size 2); started again while "
        "chunk 2's retry (world size 1) was held at the end of step 4",
        action="the trigger stopped the job once the head declared the node dead (node_lost); the retry at world size 1 "
        "from step 2 resharded and certified; chunk 3 refused the warm job and started cold at world size 2 from step 4 "
        "resharded and certified; data order, LR and batch equal a run that never changed size",
        steps_lost=len(retrained),
        run_dir=run_dir,
    )
