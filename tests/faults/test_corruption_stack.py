"""A checkpoint corrupted on the worker's disk after it was validated and published, full stack: a run DAG
through real Airflow code (`airflow dags test`) on the session's Ray head and S3. Bit rot between two
chunks: one byte of checkpoint 6's model shard flips after chunk 1 published it. The next chunk must not
load it: its resume check finds the file no longer matches the manifest, quarantines the local copy and,
rather than fall back to the older local checkpoint 3 and train steps 4-6 again, restores the published
copy of step 6, verified against its checksums, and resumes there."""

from __future__ import annotations

import pytest

from relay.checkpoints.resume import quarantined
from relay.runs import layout
from relay.runs.metrics import read_events
from relay.s3.store import store_for_spec
from relay.spec.run_spec import load_spec
from support.corrupt import flip
from support.faults import assert_finished_as
from support.helpers import relay_cli, start_dags_test, write_spec

# The faults lane's: CI proves each corruption refused and quarantined in test_corruption.py, and alerted in
# tests/airflow/test_alerts_dag.py.
pytestmark = pytest.mark.lane("faults")

STEPS = 12


def test_a_published_checkpoint_rotting_on_the_local_disk_is_never_loaded(airflow_home, tmp_path, fault_row, uninterrupted):
    spec_path = write_spec(airflow_home["runs"], name="rot", **{"trainer.settings.save_freq": 3})
    spec = load_spec(spec_path, check_environment=False)
    run_dir = spec.run_dir("rot")
    # Chunk 1 done: trained to 6 (checkpoints 3 and 6), validated and published as its DAG tasks do.
    for args in (
        ("train", str(spec_path), "--to-step", "6", "--run", "rot", "--offline"),
        ("checkpoint", "publish", str(run_dir), spec.s3.uri, "--run", "rot", "--step", "6"),
    ):
        r = relay_cli(*args)
        assert r.returncode == 0, r.stderr[-3000:]
    flip(run_dir / "global_step_6" / "actor" / layout.shard_name("model", 1, 0))  # then the disk rots

    rc, out = start_dags_test(airflow_home, "relay_rot", {"run": "rot"}).wait()
    assert rc == 0, out[-6000:]
    assert "quarantined checkpoint step 6: integrity failed" in out and "fails its CRC32 check" in out
    uri = store_for_spec(spec).step_uri("rot", 6)
    assert f"restored step 6 from {uri}" in out
    assert f"restored from its published copy {uri}" in out, "the fallback alert says what Relay did"
    starts = [
        (e["chunk"], e["resumed_from"], e.get("restored_from")) for e in read_events(run_dir) if e["event"] == "chunk_start"
    ]
    assert starts[-1] == (2, 6, uri), starts  # (the first: the CLI's chunk 1)
    assert [q["step"] for q in quarantined(run_dir)] == [6], "moved aside, not deleted"
    assert_finished_as(run_dir, uninterrupted, STEPS, out)
    fault_row(
        case="corruption",
        layer="full stack (Airflow, Ray, S3)",
        fault="bit rot between chunks: one byte of checkpoint 6's model shard flips on the worker's disk "
        "after chunk 1 validated and published it",
        action="chunk 2's resume check refused the local copy (integrity: CRC32 against the manifest), "
        "quarantined it and, instead of falling back to local step 3, restored the published step 6 "
        "(CRC64NVME-verified, validated) and resumed there; the fallback was alerted",
        steps_lost=0,
        run_dir=run_dir,
        store=store_for_spec(spec),
    )
