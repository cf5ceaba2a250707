"""The Ray head dies while the trainer runs on a worker node and lives on, an orphan; full stack: a run
DAG through real Airflow code (`airflow dags test`) on a two-node Ray cluster of the case's own, with
the real CPU trainer and the session's S3. The trainer is held after step 8 at a fault point; the head
node dies; a replacement head takes the address; Airflow's retry runs the chunk there under a newer
lease. The orphan, let go, must find the lease moved at its next step and stop without writing
anything; the run finishes bitwise equal to an uninterrupted run, with 2 steps lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.runs.lease import Lease
from relay.spec.run_spec import load_spec
from support.faults import alive
from support.helpers import start_dags_test
from support.polling import wait_for
from support.private_stack import PrivateRay
from support.ray_head import PAUSED_AFTER, RESUMED_FROM, finished_as_uninterrupted, spec_for

# The faults lane's: a two-node Ray cluster of its own. CI proves the fencing by the lease in
# tests/trainers/test_lease_fencing.py.
pytestmark = pytest.mark.lane("faults")

TRAINER_NODE = {"relay_trainer_node": 1}


def test_an_orphaned_trainer_cannot_write_once_the_next_attempt_holds_the_lease(
    airflow_home, tmp_path, uninterrupted, fault_row
):
    cluster = PrivateRay(tmp_path / "ray")
    cluster.start_head()
    cluster.add_worker(TRAINER_NODE)
    worker_node = cluster.nodes[-1]
    marker = tmp_path / "paused"
    spec = spec_for(airflow_home["runs"], "rayorphan", marker, **{"ray.entrypoint_resources": TRAINER_NODE})
    run_dir = load_spec(spec, check_environment=False).run_dir("rayorphan")
    try:
        dag = start_dags_test(airflow_home, "relay_rayorphan", {}, env={"AIRFLOW_CONN_RELAY_RAY": cluster.address})
        wait_for(lambda: marker.exists() and marker.read_text(), 300, "trainer paused after step 8", gave_up=dag.ended)
        orphan = int(marker.read_text())
        token = Lease(run_dir).current()["token"]
        cluster.kill_head()
        assert alive(orphan), "the trainer lives on, on its worker node"
        # A replacement head at the same dashboard address (its GCS elsewhere: the old node never joins it).
        cluster.start_head(resources=TRAINER_NODE, new_gcs_port=True)
        wait_for(lambda: Lease(run_dir).current()["token"] > token, 300, "the retry's newer lease", gave_up=dag.ended)
        Path(f"{marker}.go").touch()  # let the orphan go on
        wait_for(lambda: not alive(orphan), 120, "the orphan's end")
        rc, out = dag.wait()
        orphan_log = "".join(
            p.read_text(errors="replace") for p in Path(worker_node).glob("session_*/logs/job-driver-*.log")
        )
    finally:
        cluster.stop()
    assert rc == 0, out[-5000:]
    assert "refusing to write" in orphan_log, orphan_log[-3000:]
    assert f"step {PAUSED_AFTER + 1}/" not in orphan_log, "the orphan logged no step after the takeover"
    starts = finished_as_uninterrupted(run_dir, uninterrupted, out)
    assert [s for s, _ in starts] == [0, RESUMED_FROM] and starts[1][1] > token, starts
    fault_row(
        case="ray-orphan",
        layer="full stack (Airflow, Ray, S3)",
        fault=f"the Ray head node is killed after step {PAUSED_AFTER} while the trainer runs on a worker "
        "node: the trainer lives on, an orphan; a replacement head takes the address",
        action="the trigger saw the job lost; Airflow's retry took the run's lease (a newer fencing token) "
        f"and resumed from checkpoint {RESUMED_FROM} on the new head. The orphan, let go, checked the "
        'lease before its next step and exited ("refusing to write"): no metrics row, no checkpoint, '
        "no tracker write after the takeover",
        steps_lost=PAUSED_AFTER - RESUMED_FROM,
        run_dir=run_dir,
    )
