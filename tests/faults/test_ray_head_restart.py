"""The Ray head dies in the middle of a chunk and comes back, full stack: a run DAG through real Airflow
code (`airflow dags test`, its trigger run in line) on a Ray cluster of the case's own, with the real
CPU trainer and the session's S3. The trainer is held after step 8 at a fault point (RELAY_FAULT_PAUSE_AT,
once), and the head node dies there, with the trainer on it; a new head starts at the same address.
The run must finish bitwise equal to an uninterrupted run, with 2 steps lost (7 and 8, trained again
from checkpoint 6)."""

from __future__ import annotations

from relay.spec.run_spec import load_spec
from support.faults import alive
from support.helpers import start_dags_test
from support.polling import wait_for
from support.private_stack import PrivateRay
from support.ray_head import PAUSED_AFTER, RESUMED_FROM, finished_as_uninterrupted, spec_for


def test_the_ray_head_dies_mid_chunk_and_comes_back(airflow_home, tmp_path, uninterrupted, fault_row):
    cluster = PrivateRay(tmp_path / "ray")
    cluster.start_head()
    marker = tmp_path / "paused"
    spec = spec_for(airflow_home["runs"], "rayrestart", marker)
    run_dir = load_spec(spec, check_environment=False).run_dir("rayrestart")
    try:
        dag = start_dags_test(airflow_home, "relay_rayrestart", {}, env={"AIRFLOW_CONN_RELAY_RAY": cluster.address})
        wait_for(lambda: marker.exists() and marker.read_text(), 300, "trainer paused after step 8", gave_up=dag.ended)
        trainer = int(marker.read_text())
        cluster.kill_head()  # the node dies, and the trainer on it
        assert not alive(trainer)
        cluster.start_head()  # back at the same address, knowing no job
        rc, out = dag.wait()
    finally:
        cluster.stop()
    assert rc == 0, out[-5000:]
    assert "unreachable" in out and "unknown to the cluster" in out, "the trigger waited for the head, then saw the job lost"
    starts = finished_as_uninterrupted(run_dir, uninterrupted, out)
    assert [s for s, _ in starts] == [0, RESUMED_FROM], starts
    fault_row(
        case="ray-head-restart",
        layer="full stack (Airflow, Ray, S3)",
        fault=f"the Ray head node is killed (SIGKILL, every process) with the trainer on it, after step "
        f"{PAUSED_AFTER} of a 12-step chunk; a new head starts at the same address",
        action="the trigger kept polling through the outage (up to 5 min), then found the job unknown to "
        "the new head (LOST); the task failed and Airflow's retry resubmitted the chunk under a new "
        f"lease, which resumed from checkpoint {RESUMED_FROM}",
        steps_lost=PAUSED_AFTER - RESUMED_FROM,
        run_dir=run_dir,
    )
