"""A warm chunk whose previous checkpoint fails the gate, full stack: a run DAG with `chunks.handoff: warm` through
real Airflow code (`airflow dags test`) on the session's Ray head and S3. Chunk 1's job is held just after it
committed step 6 (RELAY_FAULT_PAUSE_AT=after_tracker@6), one byte of that checkpoint's model shard flips, and the
job goes on warm into chunk 2. Chunk 1's validation refuses the checkpoint (quarantined, the tracker back to step
3): the warm job stops at its next step without committing anything, and the DAG run fails at that validation.
The next DAG run resumes cold from step 3, and the run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.checkpoints.resume import quarantined
from relay.jobs.ray_jobs import TERMINAL, RayJobs
from relay.runs import handoff, layout
from relay.runs.metrics import read_events
from relay.s3.store import store_for_spec
from relay.spec.run_spec import load_spec
from support.corrupt import flip
from support.faults import assert_finished_as
from support.helpers import start_dags_test, write_spec
from support.polling import wait_for

# The faults lane's: CI proves a warm chunk stopped by a quarantined checkpoint in tests/trainers/test_warm_handoff.py.
pytestmark = pytest.mark.lane("faults")

STEPS = 12


def test_a_warm_chunk_stops_when_the_checkpoint_it_went_on_from_fails_the_gate(
    airflow_home, ray_address, tmp_path, fault_row, uninterrupted
):
    marker = tmp_path / "paused"
    spec_path = write_spec(
        airflow_home["runs"],
        name="warmgate",
        **{
            "chunks.handoff": "warm",
            "airflow.approvals": False,
            "trainer.settings.save_freq": 3,
            "ray.env_vars": {
                "RELAY_FAULT_PAUSE_AT": "after_tracker@6",
                "RELAY_FAULT_ONCE": str(marker),
                "RELAY_FAULT_PAUSE_S": "300",
            },
        },
    )
    spec = load_spec(spec_path, check_environment=False)
    run_dir = spec.run_dir("warmgate")
    dag = start_dags_test(airflow_home, "relay_warmgate", {"run": "warmgate"})
    wait_for(
        lambda: marker.exists() and marker.read_text(), 300, "chunk 1's job held after committing step 6", gave_up=dag.ended
    )
    flip(run_dir / "global_step_6" / "actor" / layout.shard_name("model", 1, 0))  # after its commit, before its gate
    Path(f"{marker}.go").touch()
    rc, out = dag.wait()
    assert rc != 0, "the DAG run fails at chunk 1's validation"
    assert "fails its CRC32 check" in out, out[-5000:]
    record = handoff.warm(run_dir, 2)
    assert record is not None, "the job went on warm into chunk 2"
    jobs = RayJobs(ray_address)
    wait_for(lambda: getattr(jobs.get(record["attempt"]), "status", None) in TERMINAL, 120, "the warm job's end")
    refused = [e for e in read_events(run_dir) if e["event"] == "handoff_refused"]
    assert len(refused) == 1 and refused[0]["chunk"] == 2, refused
    assert "checkpoint 6, which it went on from, is no longer the run's latest" in refused[0]["why"]
    assert layout.read_tracker(run_dir) == 3, "the tracker fell back to the newest valid checkpoint"
    assert not list(run_dir.glob("global_step_[7-9]")) and not list(run_dir.glob("global_step_1[0-2]")), (
        "no step of the quarantined line was committed"
    )
    assert [q["step"] for q in quarantined(run_dir)] == [6]

    again = start_dags_test(airflow_home, "relay_warmgate", {"run": "warmgate"})
    rc, out = again.wait()
    assert rc == 0, out[-5000:]
    starts = [(e["chunk"], e["resumed_from"], e["warm"]) for e in read_events(run_dir) if e["event"] == "chunk_start"]
    assert starts == [(1, 0, False), (2, 6, True), (1, 3, False), (2, 6, True)], starts
    assert_finished_as(run_dir, uninterrupted, STEPS, out)
    fault_row(
        case="warm-gate-refusal",
        layer="full stack (Airflow, Ray, S3)",
        fault="one byte of checkpoint 6's model shard flips after chunk 1's job committed it and went on warm into "
        "chunk 2, before chunk 1's validation",
        action="the gate quarantined checkpoint 6 and moved the tracker back to step 3; the warm job saw it at its "
        "next step and stopped without committing (exit 4); the DAG run failed at that validation, and the next "
        "DAG run resumed cold from step 3",
        steps_lost=STEPS // 2 - 3,
        run_dir=run_dir,
        store=store_for_spec(spec),
    )
