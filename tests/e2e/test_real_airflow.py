"""Relay on a real Airflow: the api-server, scheduler, dag-processor and triggerer as separate
processes on the machine's PostgreSQL (a database of its own, made here), with the session's Ray head
and S3 server. Runs are triggered through the REST API v2 as the UI does; a backfill goes through
the CLI; the scheduler and triggerer are killed in the middle of a chunk and started again; decisions
(a fresh start, a settings change) wait in awaiting_input and are answered over the REST API as the
Required Actions page answers them: approved, rejected, or not answered in time."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from relay.alerts import AlertLedger
from relay.data.fingerprint import sha256_file
from relay.devstack import stack
from relay.devstack.airflow_api import AirflowAPIError
from relay.jobs.ray_jobs import RayJobs
from relay.runs import layout
from relay.runs.metrics import read_events
from relay.runs.record import read_record
from relay.s3.store import store_for_spec
from relay.spec.run_spec import load_spec
from support.airflow_procs import airflow_processes, postgres_database, wait_until_parked
from support.corrupt import flip
from support.helpers import ROOT, assert_bitwise_equal, jobs_of_run, model_state, read_metrics, relay_cli, write_spec
from support.polling import wait_for

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
    write_spec(
        runs,
        name="e2e",
        **{
            "ray.env_vars": {
                "RELAY_FAULT_PAUSE_AT": "after_step@8",
                "RELAY_FAULT_ONCE": str(faults / "e2e"),
                "RELAY_FAULT_PAUSE_S": "1200",
            }
        },
    )
    for i, day in enumerate(MONDAYS):  # each week's prompts differ: its run freezes its own
        table = pq.read_table(DATA)
        pq.write_table(table.slice(i), data / f"prompts-{day}.parquet")
    # Decisions asked in the UI (relay.airflow.decisions): one chunk of 6 steps; one spec whose decisions time out.
    write_spec(runs, name="decide", total_steps=6, chunk_steps=6)
    # Its 21 s outlast the park's own executor event: with a timeout of seconds, Airflow's scheduler resumed the task
    # before the LocalExecutor reported the parked process's exit, took that report for the resumed try's, and failed
    # the task without running it (Airflow 3.3's AWAITING_INPUT sweep against a late executor event, under CI's load).
    write_spec(runs, name="hurry", total_steps=6, chunk_steps=6, **{"approvals.timeout_minutes": 0.35})
    # A fallback question; and a deadline already past (its ETA and Airflow's deadline alert both alert).
    write_spec(
        runs,
        name="careful",
        total_steps=6,
        chunk_steps=6,
        **{"approvals.max_steps_lost": 1, "trainer.settings.save_freq": 3, "alerts.deadline": "2026-01-01T00:00:00Z"},
    )
    # A chunk whose job holds after step 3 past its 0.5-minute timeout, while the triggerer is down.
    write_spec(
        runs,
        name="outage",
        total_steps=6,
        chunk_steps=6,
        **{
            "ray.chunk_timeout_minutes": 0.5,
            "alerts.stall_minutes": 10,
            "ray.env_vars": {
                "RELAY_FAULT_PAUSE_AT": "after_step@3",
                "RELAY_FAULT_ONCE": str(faults / "outage"),
                "RELAY_FAULT_PAUSE_S": "1200",
            },
        },
    )
    write_spec(
        runs,
        name="weekly",
        total_steps=6,
        chunk_steps=6,
        **{
            "airflow.schedule": "0 0 * * 1",
            "airflow.start_date": "2025-01-06",
            "data.train_files": [str(data / "prompts-{{ ds_nodash }}.parquet")],
            "data.val_files": [],
        },
    )

    with (
        postgres_database("relay_e2e") as db_url,
        airflow_processes(
            base,
            runs,
            db_url,
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="60",
            AIRFLOW__SCHEDULER__TRIGGER_TIMEOUT_CHECK_INTERVAL="2",
        ) as af,
    ):
        yield {**af, "runs": runs, "data": data, "faults": faults}


@pytest.mark.fault
def test_a_triggered_run_survives_its_scheduler_and_triggerer_being_killed_mid_chunk(
    airflow, ray_address, uninterrupted, fault_row
):
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
            stack.start_process(
                f"airflow-{comp}", [str(stack.bin_dir() / "airflow"), comp], airflow["env"], cwd=airflow["home"]
            )
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
    fault_row(
        case="scheduler-kill",
        layer="full stack (Airflow's 4 processes on PostgreSQL, Ray, S3)",
        fault="the Airflow scheduler and triggerer are SIGKILLed while chunk 2's train task is deferred on its "
        "running Ray job (held after step 8), and started again 3 s later",
        action="the new triggerer re-attached to the same Ray job (its submission id is deterministic per run, "
        "chunk and try): exactly one job ran for chunk 2, it trained on undisturbed, and the run "
        "succeeded with steps 6 and 12 published and announced as asset events",
        steps_lost=0,
        run_dir=run_dir,
        store=store_for_spec(spec),
    )


@pytest.mark.fault
@pytest.mark.lane("faults")  # adopting a healthy job is CI's in tests/e2e/test_retries.py
def test_a_chunk_whose_triggerer_was_down_past_its_timeout_is_adopted_not_trained_again(airflow, ray_address, fault_row):
    """The triggerer is down while a chunk's job trains past the chunk's timeout: no trigger stops the job, Airflow's
    own defer timeout fails the task's try, and the next try adopts the job, which holds the run's lease and made
    a step within the stall limit, instead of stopping it and training its steps again."""
    api, held = airflow["api"], airflow["faults"] / "outage"
    api.wait_for_dag("relay_outage")
    t0 = time.time()
    run_id = api.trigger("relay_outage", {"run": "down", "alert_channels": []})["dag_run_id"]

    def train(**want):
        t = next((t for t in api.task_instances("relay_outage", run_id) if t["task_id"] == "chunk_01.train"), {})
        return all(t.get(k) == v for k, v in want.items())

    try:
        # The triggerer goes down as soon as the task defers on its job: on a loaded machine the job's start-up
        # alone can outlast the 30 s timeout, which a running triggerer would enforce by stopping the job.
        wait_for(lambda: train(state="deferred"), 600, "chunk 1's train task to defer on its Ray job")
        assert stack.kill_process("airflow-triggerer")
        wait_for(held.exists, 600, "chunk 1's job to hold after step 3")
        wait_for(
            lambda: train(state="deferred", try_number=2),
            300,
            "Airflow's defer timeout to fail try 1 and try 2 to defer on the same job",
        )
    finally:
        Path(f"{held}.go").touch()  # the job goes on
        stack.start_process(
            "airflow-triggerer", [str(stack.bin_dir() / "airflow"), "triggerer"], airflow["env"], cwd=airflow["home"]
        )
    assert api.wait_for_run("relay_outage", run_id, timeout=900)["state"] == "success"
    [job] = [j for j in jobs_of_run(ray_address, "down", t0) if (j.metadata or {}).get("relay_chunk") == "1"]
    assert str(job.status) == "SUCCEEDED", "one job trained the chunk: adopted, not stopped and submitted again"
    log = api.task_log("relay_outage", run_id, "chunk_01.train", try_number=2)
    assert f"this try adopts Ray job {job.submission_id} of an earlier try" in log, log[-3000:]
    spec = load_spec(airflow["runs"] / "outage.yaml", check_environment=False)
    run_dir = spec.run_dir("down")
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 7)), "each step once: nothing retrained"
    fault_row(
        case="triggerer-down",
        layer="full stack (Airflow's 4 processes on PostgreSQL, Ray, S3)",
        fault="the triggerer is down while chunk 1's job trains past the chunk's timeout (held after step 3)",
        action="Airflow's defer timeout failed the try; its retry found the job holding the run's lease with a "
        "recent step and adopted it (its timeout counted again from the adoption); the job trained on to "
        "step 6, and no step was trained twice",
        steps_lost=0,
        run_dir=run_dir,
        store=store_for_spec(spec),
    )


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
    r = stack.airflow_cli(
        airflow["env"],
        "backfill",
        "create",
        "--dag-id",
        "relay_weekly",
        "--from-date",
        "2025-01-06",
        "--to-date",
        "2025-01-13",
        "--max-active-runs",
        "1",
        check=False,
    )
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


def awaiting(api, dag_id: str, run_id: str, task_id: str) -> dict:
    """Wait until the task asks its question (awaiting_input); its human-in-the-loop request."""
    wait_for(
        lambda: any(t["task_id"] == task_id and t["state"] == "awaiting_input" for t in api.task_instances(dag_id, run_id)),
        300,
        f"{task_id} to wait for a decision",
    )
    wait_until_parked(dag_id, run_id, task_id)  # Airflow 3.3.2 fails a task answered before this
    return api.decision(dag_id, run_id, task_id)


def trained_offline(spec_path: Path, run: str) -> Path:
    """A run with a checkpoint (step 6), trained with `relay train` outside Airflow."""
    r = relay_cli("train", str(spec_path), "--to-step", "6", "--run", run, "--offline")
    assert r.returncode == 0, r.stderr[-2000:]
    return load_spec(spec_path, check_environment=False).run_dir(run)


def test_an_unconfirmed_fresh_start_waits_for_an_approval_in_the_ui(airflow):
    """An unconfirmed fresh start of a run with checkpoints asks (what would be archived), alerts once with the
    link, and goes on when approved (a settings change is approved in the browser: tests/e2e/test_ui.py)."""
    api, spec_path = airflow["api"], airflow["runs"] / "decide.yaml"
    api.wait_for_dag("relay_decide")
    rd = trained_offline(spec_path, "fs")
    before = read_record(rd)["incarnation"]

    run_id = api.trigger("relay_decide", {"run": "fs", "fresh_start": True, "alert_channels": []})["dag_run_id"]
    asked = awaiting(api, "relay_decide", run_id, "preflight.run")
    assert asked["subject"] == "Start run fs again from step 0?" and asked["options"] == ["Approve", "Reject"]
    assert f"`{rd}` (steps 6)" in asked["body"] and "/.archive/fs-<time>-<random>/" in asked["body"], asked["body"]
    assert asked["response_received"] is False
    [alert] = AlertLedger(rd).entries()
    assert alert["kind"] == "decision" and alert["task"] == "preflight.run"
    api.answer("relay_decide", run_id, "preflight.run", "Approve")
    assert api.wait_for_run("relay_decide", run_id, timeout=900)["state"] == "success"
    record = read_record(rd)
    assert record["incarnation"] != before, "a new incarnation began"
    assert "fresh start approved by admin in the Airflow UI at " in record["started_by"]
    [old] = (rd.parent / ".archive").glob("fs-*")
    assert (old / "global_step_6").is_dir(), "the old run was moved aside, not deleted"


def test_a_cleared_dag_run_does_not_start_its_run_again(airflow):
    """A DAG run whose conf asks for a (confirmed) fresh start performs it once: cleared and run again as a whole,
    its preflight.run says so and the run continues from its checkpoint; nothing is archived a second time."""
    api, spec_path = airflow["api"], airflow["runs"] / "decide.yaml"
    api.wait_for_dag("relay_decide")
    rd = trained_offline(spec_path, "fc")
    run_id = api.trigger(
        "relay_decide", {"run": "fc", "fresh_start": True, "confirm_fresh_start": "fc", "alert_channels": []}
    )["dag_run_id"]
    assert api.wait_for_run("relay_decide", run_id, timeout=900)["state"] == "success"
    after_first = read_record(rd)["incarnation"]
    rows = read_metrics(rd)
    assert [r["step"] for r in rows] == list(range(1, 7)) and len(list((rd.parent / ".archive").glob("fc-*"))) == 1

    tasks = [t["task_id"] for t in api.task_instances("relay_decide", run_id)]
    api.clear_task_instances("relay_decide", run_id, tasks)
    wait_for(
        lambda: api.dag_run("relay_decide", run_id)["state"] in ("success", "failed")
        and any(t["try_number"] == 2 for t in api.task_instances("relay_decide", run_id) if t["task_id"] == "preflight.run"),
        600,
        "the cleared DAG run to run again",
    )
    assert api.wait_for_run("relay_decide", run_id, timeout=900)["state"] == "success"
    assert read_record(rd)["incarnation"] == after_first, "not started again"
    assert len(list((rd.parent / ".archive").glob("fc-*"))) == 1, "nothing archived a second time"
    assert read_metrics(rd) == rows and layout.read_tracker(rd) == 6, "nothing trained again"
    log = api.task_log("relay_decide", run_id, "preflight.run", try_number=2)
    assert f"DAG run relay_decide/{run_id} already started run fc again from step 0" in log, log[-3000:]


def test_a_rejected_or_unanswered_decision_stops_the_dag_run_and_changes_nothing(airflow):
    """A rejection is a person's decision: the asking task and every task after it are skipped (not failed), its log
    says in a short message who rejected what and that nothing changed (no traceback), and so does the DAG run's
    note. No answer in time fails the DAG run."""
    api = airflow["api"]
    for dag, spec_name, run, answer in (("relay_decide", "decide", "fr", "Reject"), ("relay_hurry", "hurry", "ft", None)):
        api.wait_for_dag(dag)
        rd = trained_offline(airflow["runs"] / f"{spec_name}.yaml", run)
        before = read_record(rd)["incarnation"]
        run_id = api.trigger(dag, {"run": run, "fresh_start": True, "alert_channels": []})["dag_run_id"]
        if answer:
            awaiting(api, dag, run_id, "preflight.run")
            api.answer(dag, run_id, "preflight.run", answer)
        # Unanswered, the question's 21 s run out: nothing waits for it; the request is read back once the run has
        # ended.
        ended = api.wait_for_run(dag, run_id, timeout=600)
        assert ended["state"] == ("success" if answer else "failed"), ended
        asked = api.decision(dag, run_id, "preflight.run")
        assert asked["subject"] == f"Start run {run} again from step 0?", asked
        states = {t["task_id"]: t["state"] for t in api.task_instances(dag, run_id)}
        assert read_record(rd)["incarnation"] == before and (rd / "global_step_6").is_dir(), "nothing was changed"
        assert not list((rd.parent / ".archive").glob(f"{run}-*")), "nothing was archived"
        log = api.task_log(dag, run_id, "preflight.run")
        if answer:
            assert set(states.values()) == {"success", "skipped"} or set(states.values()) == {"skipped"}, states
            assert states["preflight.run"] == "skipped" and states["chunk_01.train"] == "skipped", states
            assert "'Reject' chosen by admin in the Airflow UI" in log and "Nothing was changed" in log, log[-3000:]
            assert "Traceback" not in log, log[-3000:]
            note = ended.get("note") or ""
            assert "'Reject' chosen by admin" in note and "Nothing was changed" in note, note
        else:
            assert states["preflight.run"] == "failed" and states.get("chunk_01.train") in (None, "upstream_failed")
            assert "nobody answered" in log and "nothing was changed" in log, log[-3000:]


def test_a_fallback_that_loses_too_many_steps_waits_for_a_choice_and_a_missed_deadline_alerts(airflow):
    """Checkpoint 6 quarantined, 3 the newest valid: resuming trains 3 steps again, more than the spec's
    approvals.max_steps_lost (1). The chunk's train task asks (resume from step 3, or stop), and the approval is
    recorded before the chunk trains steps 4..6 again. The same run is past its alerts.deadline."""
    api, spec_path = airflow["api"], airflow["runs"] / "careful.yaml"
    api.wait_for_dag("relay_careful")
    rd = trained_offline(spec_path, "fb")
    flip(rd / "global_step_6" / "actor" / layout.shard_name("model", 1, 0))
    r = relay_cli("checkpoint", "validate", str(rd), "--step", "6", "--quarantine")
    assert r.returncode == 1 and layout.read_tracker(rd) == 3, r.stdout + r.stderr

    run_id = api.trigger("relay_careful", {"run": "fb", "alert_channels": []})["dag_run_id"]
    asked = awaiting(api, "relay_careful", run_id, "chunk_01.train")
    assert asked["subject"] == "Resume run fb from step 3, 3 steps back?", asked
    assert asked["options"] == ["Resume from step 3", "Stop the run"]
    assert "trains steps 4..6 again" in asked["body"] and "approvals.max_steps_lost (1)" in asked["body"]
    api.answer("relay_careful", run_id, "chunk_01.train", "Resume from step 3")
    assert api.wait_for_run("relay_careful", run_id, timeout=900)["state"] == "success"
    [approved] = [e for e in read_events(rd) if e["event"] == "fallback_approved"]
    assert (approved["quarantined"], approved["resume_from"], approved["by"]) == (6, 3, "admin")
    starts = [e for e in read_events(rd) if e["event"] == "chunk_start"]
    assert starts[-1]["resumed_from"] == 3 and layout.read_tracker(rd) == 6, "steps 4..6 trained again"

    # The spec's alerts.deadline was already past: the train task's ETA check alerted that the run will miss it,
    # and Airflow's deadline alert (FIXED_DATETIME of the same time) called Relay's callback in the executor for
    # the DAG run still going; each once.
    def both():
        whats = [e["what"] for e in AlertLedger(rd).entries() if e["kind"] == "deadline"]
        return whats if len(whats) == 2 else None

    whats = sorted(wait_for(both, 120, "the ETA's alert and Airflow's deadline alert"))
    assert whats[0].startswith(f"DAG run {run_id} is still going at the run's deadline 2026-01-01T00:00:00Z")
    assert whats[1].startswith("run fb will miss its deadline: ETA "), whats
    assert "past the deadline 2026-01-01T00:00:00Z" in whats[1], whats
