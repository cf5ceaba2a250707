"""Relay on a real Airflow: the api-server, scheduler, dag-processor and triggerer as separate
processes on the machine's PostgreSQL (a database of its own, made here), with the session's Ray head
and S3 server. Runs are triggered through the REST API v2 as the UI does; a backfill goes through
the CLI; the scheduler and triggerer are killed in the middle of a chunk and started again."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from relay.data.fingerprint import sha256_file
from relay.devstack import stack
from relay.devstack.airflow_api import AirflowAPIError
from relay.jobs.ray_jobs import RayJobs
from relay.runs.record import read_record
from relay.runs.spec import load_spec
from relay.s3.store import store_for_spec
from support.airflow_procs import airflow_processes, postgres_database, wait_for
from support.helpers import ROOT, assert_bitwise_equal, jobs_of_run, model_state, read_metrics, write_spec

DATA = ROOT / "include" / "data" / "arith_train.parquet"
MONDAYS = ("20250106", "20250113")


@pytest.fixture(scope="module")
def airflow(tmp_path_factory, ray_address):
    """Airflow's four processes on a fresh PostgreSQL database, reading this module's run specs."""
    base = tmp_path_factory.mktemp("e2e")
    runs, data, faults = base / "runs", base / "data", base / "faults"
    data.mkdir()
    faults.mkdir()
    # Chunk 2's first job holds after step 8 until the test lets it go: it is surely mid-chunk while the
    # scheduler and triggerer are down, however fast or loaded the machine.
    write_spec(runs, name="e2e", **{"ray.env_vars": {"RELAY_FAULT_PAUSE_AT": "after_step@8",
                                                     "RELAY_FAULT_ONCE": str(faults / "e2e"),
                                                     "RELAY_FAULT_PAUSE_S": "1200"}})
    for i, day in enumerate(MONDAYS):  # each week's prompts differ: its run freezes its own
        table = pq.read_table(DATA)
        pq.write_table(table.slice(i), data / f"prompts-{day}.parquet")
    write_spec(runs, name="weekly", total_steps=6, chunk_steps=6, **{
        "airflow.schedule": "0 0 * * 1", "airflow.start_date": "2025-01-06",
        "data.train_files": [str(data / "prompts-{{ ds_nodash }}.parquet")], "data.val_files": []})

    with postgres_database("relay_e2e") as db_url, airflow_processes(
            base, runs, db_url, AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="60") as af:
        yield {**af, "runs": runs, "data": data, "faults": faults}


@pytest.mark.fault
def test_a_triggered_run_survives_its_scheduler_and_triggerer_being_killed_mid_chunk(airflow, ray_address, uninterrupted,
                                                                                   fault_row):
    api, held = airflow["api"], airflow["faults"] / "e2e"
    api.wait_for_dag("relay_e2e")
    t0 = time.time()
    run_id = api.trigger("relay_e2e", {"run": "ui", "alert_channels": []})["dag_run_id"]

    def chunk_2_held_and_deferred():
        states = {t["task_id"]: t["state"] for t in api.task_instances("relay_e2e", run_id)}
        return held.exists() and states.get("chunk_02.train") == "deferred"

    try:
        wait_for(chunk_2_held_and_deferred, 600, "chunk 2's job to train (held after step 8) with its task deferred")
        jobs = RayJobs(ray_address)
        assert [j.status for j in jobs.live_jobs_of_run("e2e", "ui")], "chunk 2's job is training"
        for comp in ("scheduler", "triggerer"):
            assert stack.kill_process(f"airflow-{comp}")
        time.sleep(3)
        for comp in ("scheduler", "triggerer"):
            stack.start_process(f"airflow-{comp}", [str(stack.bin_dir() / "airflow"), comp], airflow["env"],
                                cwd=airflow["home"])
    finally:
        Path(f"{held}.go").touch()  # the job goes on (a job held at its fault point would keep a Ray CPU)

    run = api.wait_for_run("relay_e2e", run_id, timeout=900)
    assert run["state"] == "success", api.task_instances("relay_e2e", run_id)
    chunk_2 = [j for j in jobs_of_run(ray_address, "ui", t0) if (j.metadata or {}).get("relay_chunk") == "2"]
    assert [str(j.status) for j in chunk_2] == ["SUCCEEDED"], "re-attached to its job, not a second one"

    spec = load_spec(airflow["runs"] / "e2e.yaml", check_environment=False)
    assert [m.step for m in store_for_spec(spec).published("ui")] == [6, 12]
    events = api.asset_events(source_dag_id="relay_e2e")
    assert [(e["extra"]["run"], e["extra"]["step"]) for e in events] == [("ui", 6), ("ui", 12)]
    run_dir = spec.run_dir("ui")
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 13)), "each step once: nothing retrained"
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), uninterrupted)
    fault_row(case="scheduler-kill", layer="full stack (Airflow's 4 processes on PostgreSQL, Ray, S3)",
              fault="the Airflow scheduler and triggerer are SIGKILLed while chunk 2's train task is deferred on its "
                    "running Ray job (held after step 8), and started again 3 s later",
              action="the new triggerer re-attached to the same Ray job (its submission id is deterministic per run, "
                     "chunk and try): exactly one job ran for chunk 2, it trained on undisturbed, and the run "
                     "succeeded with steps 6 and 12 published and announced as asset events", steps_lost=0,
              run_dir=run_dir, store=store_for_spec(spec))


def test_the_api_server_listens_on_loopback_only(airflow):
    from security.test_bind import is_loopback, listening

    ips = listening(stack.ports()["RELAY_AIRFLOW_API_PORT"])
    assert ips and all(is_loopback(ip) for ip in ips), f"the Airflow API listens on {ips}"


def test_an_invalid_form_creates_no_run(airflow):
    api = airflow["api"]
    api.wait_for_dag("relay_e2e")
    before = len(api.dag_runs("relay_e2e"))
    for conf in ({"run": "../../etc"}, {"fresh_start": "yes"}, {"alert_channels": ["pager"]}):
        with pytest.raises(AirflowAPIError) as refused:
            api.trigger("relay_e2e", conf)
        assert refused.value.status == 400, refused.value.body
        assert refused.value.body.startswith('{"detail": "Nothing was triggered. ') and "e.g." in refused.value.body
        assert "Failed validating" not in refused.value.body, "plain words, not jsonschema's dump"
    assert len(api.dag_runs("relay_e2e")) == before


def test_a_backfill_trains_each_week_in_order_in_its_own_namespace(airflow):
    api = airflow["api"]
    api.wait_for_dag("relay_weekly")
    r = stack.airflow_cli(airflow["env"], "backfill", "create", "--dag-id", "relay_weekly", "--from-date",
                          "2025-01-06", "--to-date", "2025-01-13", "--max-active-runs", "1", check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

    def ended():
        runs = [x for x in api.dag_runs("relay_weekly") if x["run_type"] == "backfill"]
        return runs if len(runs) == 2 and all(x["state"] in ("success", "failed") for x in runs) else None

    runs = sorted(wait_for(ended, 900, "both backfill runs to end"), key=lambda x: x["logical_date"])
    assert [x["state"] for x in runs] == ["success", "success"]
    assert [x["logical_date"][:10] for x in runs] == ["2025-01-06", "2025-01-13"]
    assert runs[0]["end_date"] <= runs[1]["start_date"], "one run at a time, oldest first"

    spec = load_spec(airflow["runs"] / "weekly.yaml", check_environment=False)
    for day in MONDAYS:
        run_dir = spec.run_dir(f"weekly-{day}")
        frozen = read_record(run_dir)["data"]["files"]
        assert [f["sha256"] for f in frozen] == [sha256_file(airflow["data"] / f"prompts-{day}.parquet")[0]]
        assert (run_dir / "global_step_6" / "relay_manifest.json").is_file()
        assert [m.step for m in store_for_spec(spec).published(f"weekly-{day}")] == [6]
