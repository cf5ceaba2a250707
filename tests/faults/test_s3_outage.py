"""The S3 server is stopped during a publish and started again later, full stack: a run DAG through real
Airflow code (`airflow dags test`) on the session's Ray head, publishing to an S3 server (SeaweedFS) of
the case's own. The publish of checkpoint 6 is held at a fault point once its files are uploaded and
before its manifest and `latest` (RELAY_FAULT_PAUSE_AT=publish_files@6): the server is SIGKILLed there.
While it is down and after it is back, a reader polling `latest` must never see a step whose manifest is
missing or whose objects do not match it; the publish completes after the restart; training never
waited for it and the run ends bitwise equal to an uninterrupted one."""

from __future__ import annotations

from pathlib import Path

import pytest

from relay.common.errors import StoreError
from relay.runs.metrics import read_events
from relay.s3.store import CheckpointStore, s3_client
from relay.spec.run_spec import load_spec
from support.faults import assert_finished_as
from support.helpers import start_dags_test, write_spec
from support.polling import wait_for
from support.private_stack import PrivateS3, stack_env

# The faults lane's: an S3 server of its own, stopped and started. CI proves publishes through S3's errors in
# test_s3_faults.py.
pytestmark = pytest.mark.lane("faults")

STEPS = 12


def test_s3_stopped_during_a_publish_and_restarted_later(airflow_home, tmp_path, fault_row, uninterrupted):
    s3 = PrivateS3(tmp_path / "s3")
    s3.start()
    marker = tmp_path / "paused"
    # Retries 4 s apart: the server is back (a few seconds) before the publish's retries run out.
    spec_path = write_spec(airflow_home["runs"], name="s3down", **{"airflow.retries": 5, "airflow.retry_delay_seconds": 4})
    spec = load_spec(spec_path, check_environment=False)
    run_dir = spec.run_dir("s3down")
    with stack_env(s3.client_env()):
        store = CheckpointStore(s3_client(), spec.s3.uri)
    seen: list[int] = []

    def latest_is_whole() -> None:
        """What a reader of `latest` sees is whole, or there is no `latest`."""
        try:
            latest = store.latest("s3down")
            m = latest and store.manifest("s3down", latest["step"])
        except StoreError:
            return  # the server is down
        if latest:
            assert m is not None, f"latest names step {latest['step']}, whose manifest is missing"
            store.verify("s3down", m)  # every object there, matching the manifest
            seen.append(latest["step"])

    try:
        dag = start_dags_test(
            airflow_home,
            "relay_s3down",
            {},
            env={
                **s3.client_env(),
                "RELAY_FAULT_PAUSE_AT": "publish_files@6",
                "RELAY_FAULT_ONCE": str(marker),
                "RELAY_FAULT_PAUSE_S": "300",
            },
        )
        wait_for(marker.exists, 300, "the publish of step 6 held after its files", gave_up=dag.ended)
        latest_is_whole()
        assert seen == [] and store.manifest("s3down", 6) is None, "files uploaded, nothing published yet"
        s3.kill()
        Path(f"{marker}.go").touch()
        wait_for(
            lambda: "unreachable during" in dag.log.read_text(errors="replace"),
            300,
            "the publish's failure",
            gave_up=dag.ended,
        )
        s3.start()  # the same data folder: every object uploaded before the crash is there
        while dag.proc.poll() is None:
            latest_is_whole()
        rc, out = dag.wait()
        assert rc == 0, out[-5000:]
        latest_is_whole()
        assert [m.step for m in store.published("s3down")] == [6, STEPS]
        assert store.latest("s3down")["step"] == STEPS and set(seen) <= {6, STEPS} and STEPS in seen, seen
        for m in store.published("s3down"):
            store.verify("s3down", m)
        assert "unreachable during" in out and "What to do: start the S3 server" in out
        retried = [e for e in read_events(run_dir) if e["event"] == "publish" and e["step"] == 6]
        assert len(retried) == 1 and retried[0]["uploaded"] == 0, "the retry re-uploaded nothing already there"
        # Training never waited for S3: chunk 2 ran through the outage, and the run is the uninterrupted one.
        assert_finished_as(run_dir, uninterrupted, STEPS)
        fault_row(
            case="s3-stopped",
            layer="full stack (Airflow, Ray, S3)",
            fault="the S3 server (SeaweedFS) is SIGKILLed in the middle of checkpoint 6's publish (its files "
            "uploaded, its manifest and latest not yet) and started again later",
            action='the publish task failed with "S3 ... unreachable during ..." and a what-to-do; a reader '
            "polling latest never saw an incomplete checkpoint (no latest until step 6 was whole); "
            "Airflow's retry published step 6 after the restart, skipping the objects already there, "
            "then latest moved; chunk 2 trained through the outage",
            steps_lost=0,
            run_dir=run_dir,
            store=store,
        )
    finally:
        s3.kill()  # after the row: its "data lost" column reads what S3 holds
