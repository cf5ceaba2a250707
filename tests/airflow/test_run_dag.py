"""A run DAG through real Airflow code (`airflow dags test`) on the session's real Ray head."""

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from relay.insights import goodput
from relay.jobs.ray_jobs import RayJobs
from relay.runs import layout
from relay.runs.lease import Lease
from relay.runs.metrics import SUPERSEDED, read_events, read_jsonl
from relay.runs.run import Run
from relay.s3.store import store_for_spec
from relay.spec.run_spec import load_spec
from support.helpers import (
    ROOT,
    assert_bitwise_equal,
    dags_test,
    jobs_of_run,
    model_state,
    read_metrics,
    relay_cli,
    start_dags_test,
    train,
    write_spec,
)

pytestmark = pytest.mark.services  # Airflow's own processes or DAG runs, on the session's Ray head and S3

STEPS = 12  # 2 chunks of 6


@pytest.fixture(scope="module")
def spec_path(airflow_home) -> Path:
    # Approvals off: an unconfirmed fresh start is refused unattended (`airflow dags test` has no API server to
    # answer a question; the asked path runs on the real scheduler: tests/e2e/test_real_airflow.py).
    return write_spec(airflow_home["runs"], name="t", **{"checkpoints.hf_export": True, "airflow.approvals": False})


def run_dir(spec_path: Path, run: str) -> Path:
    return load_spec(spec_path, check_environment=False).run_dir(run)


@pytest.fixture(scope="module")
def killed_run(airflow_home, ray_address, spec_path) -> dict:
    """Run "killed" of spec t through `airflow dags test`, its chunk-2 job stopped at a random step."""
    rd = run_dir(spec_path, "killed")
    kill_at = random.Random(os.environ.get("RELAY_TEST_SEED")).randint(8, 10)  # inside chunk 2 (steps 7..12)
    dag_test = start_dags_test(airflow_home, "relay_t", {"run": "killed"})
    jobs = RayJobs(ray_address)
    deadline = time.time() + 600
    while time.time() < deadline:
        steps = [r["step"] for r in read_metrics(rd)] if (rd / "metrics.jsonl").exists() else []
        if steps and max(steps) >= kill_at:
            # Freeze the trainer first (its pid is in the run's lease): a CPU step takes a few tens of
            # milliseconds, so the chunk would otherwise often commit step 12 before the stop lands.
            # A stopped process still dies of the SIGKILL that follows Ray's SIGTERM.
            os.kill(Lease(rd).current()["pid"], signal.SIGSTOP)
            live = jobs.live_jobs_of_run("t", "killed")
            assert len(live) == 1, live
            jobs.stop(live[0].submission_id)
            break
        time.sleep(0.05)
    returncode, out = dag_test.wait()
    return {"run_dir": rd, "returncode": returncode, "out": out}


@pytest.mark.fault
def test_killed_chunk_job_is_retried_and_resumes_bitwise(killed_run, spec_path, fault_row, uninterrupted):
    assert killed_run["returncode"] == 0, killed_run["out"][-5000:]
    assert "ended STOPPED" in killed_run["out"], "chunk 2's first try must fail because its job was stopped"
    assert "resume checklist (as `python -m relay doctor" in killed_run["out"]
    assert (
        "chunk 2/2 (steps 7..12) of run killed resumes from step 6: epoch 0, dataloader at 96 of 1000 samples "
        "(6 batches) into the epoch" in killed_run["out"]
    ), "each chunk's log starts with its resume preview"
    rd = killed_run["run_dir"]
    assert layout.read_tracker(rd) == STEPS
    assert_bitwise_equal(model_state(rd / f"global_step_{STEPS}"), uninterrupted)
    rows = read_metrics(rd)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), "no gap and no repeat"
    starts = [e for e in read_events(rd) if e["event"] == "chunk_start"]
    assert [(e["chunk"], e["resumed_from"]) for e in starts] == [(1, 0), (2, 6), (2, 6)]
    assert starts[1]["attempt"].endswith("-c02-t1") and starts[2]["attempt"].endswith("-c02-t2")
    assert starts[2]["lease_token"] > starts[1]["lease_token"]
    retrained = [r["step"] for r in read_jsonl(rd / SUPERSEDED) if r["attempt"] == starts[1]["attempt"]]
    assert retrained and min(retrained) == 7, "steps after checkpoint 6 only"
    fault_row(
        case="trainer-kill",
        layer="full stack (Airflow, Ray, S3)",
        fault=f"chunk 2's Ray job is stopped after step {max(retrained)} (its trainer frozen, then Ray's stop: "
        "SIGTERM, SIGKILL), as a preemption or a lost node ends it",
        action="the try failed (job STOPPED) with the job's log tail; Airflow's retry stopped any live job of "
        "the run, took a newer lease and resumed from checkpoint 6 (rows 7.. of the killed try kept in "
        "metrics.superseded.jsonl)",
        steps_lost=len(retrained),
        run_dir=rd,
        store=store_for_spec(load_spec(spec_path, check_environment=False)),
    )


def test_checkpoints_are_validated_published_and_announced(killed_run, airflow_home, spec_path):
    """The interrupted run was validated, published and announced, chunk by chunk."""
    spec = load_spec(spec_path, check_environment=False)
    store = store_for_spec(spec)
    assert [m.step for m in store.published("killed")] == [6, 12]
    assert store.latest("killed")["step"] == STEPS
    assert store.head(store.run_key("killed", "hf", "global_step_12", "model.safetensors")), (
        "the final step has a Hugging Face model beside it"
    )
    for step in (6, 12):
        assert (run_dir(spec_path, "killed") / f"global_step_{step}" / "relay_manifest.json").is_file()
    from relay.runs.metrics import read_events

    final = [e for e in read_events(run_dir(spec_path, "killed")) if e["event"] == "publish" and e["step"] == STEPS][-1]
    assert final["hf_verified"].startswith(f"reproduces the certificate of global_step_{STEPS}: "), final
    events = asset_events(airflow_home, "relay_t_checkpoints")
    assert [(e["asset"], e["run"], e["step"]) for e in events] == [
        (f"{spec.s3.uri}/killed", "killed", 6),
        (f"{spec.s3.uri}/killed", "killed", 12),
    ], "each event on the run's own asset, its S3 prefix, through the spec's alias"
    assert events[1]["uri"] == store.step_uri("killed", 12) and events[1]["hf_model"].endswith("/hf/global_step_12/")

    page = store.client.get_object(Bucket=store.bucket, Key=store.run_key("killed", "report", "report.html"))
    assert page["ContentType"].startswith("text/html"), "the run report is published beside the checkpoints"
    assert "data:image/png;base64," in page["Body"].read().decode()

    r = dags_test(airflow_home, "relay_eval_demo", {"manifest": events[1]["manifest"]})
    assert r.returncode == 0, r.stdout[-3000:]
    assert "evaluated run killed step 12" in r.stdout


def test_the_killed_runs_goodput_adds_up_from_airflows_and_rays_marks(killed_run):
    """The goodput ledger of the killed run, from the marks its train tasks, Ray jobs, trainers, gate and publisher
    recorded: its parts add up to its wall time, its steps lost are the rows the resume superseded, and the killed
    try is a failure with its cause, its lost steps and the time its retry took to train a new step."""
    rd = killed_run["run_dir"]
    g = goodput.ledger(rd)
    assert g is not None
    assert abs(sum(g.parts.values()) - g.wall_s) < 1.0
    superseded = read_jsonl(rd / SUPERSEDED)
    assert g.steps_lost == len(superseded) > 0 and g.steps_kept == STEPS
    for part in (
        "scheduling",
        "submission",
        "startup",
        "training",
        "trained_twice",
        "save",
        "validation",
        "teardown",
        "retry_wait",
    ):
        assert g.parts[part] > 0, (part, g.parts)
    assert [(a.chunk, a.outcome) for a in g.attempts] == [(1, "finished"), (2, "failed"), (2, "finished")]
    assert all(a.dag_run and a.try_number for a in g.attempts), "each attempt is its train task's try"
    [failure] = g.failures
    assert failure.attempt.endswith("-c02-t1") and failure.cause == "preempted", failure
    assert failure.steps_lost == len(superseded) and failure.time_to_recover_s > 0
    assert [c["attempts"] for c in g.chunks()] == [1, 2]
    assert "goodput " in killed_run["out"] and "where the wall time went:" in killed_run["out"], (
        "the finish task logs the ledger"
    )


def asset_events(airflow_home, alias: str) -> list[dict]:
    """Asset events through an asset alias as the metadata DB holds them: each event's extra, and its
    asset's URI as "asset"."""
    import sqlite3

    db = airflow_home["env"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].removeprefix("sqlite:///")
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT e.extra, a.uri FROM asset_event e JOIN asset a ON a.id = e.asset_id "
            "JOIN asset_alias_asset_event x ON x.event_id = e.id "
            "JOIN asset_alias al ON al.id = x.alias_id WHERE al.name = ? ORDER BY e.id",
            (alias,),
        ).fetchall()
    return [{**json.loads(extra), "asset": uri} for extra, uri in rows]


def test_retriggering_a_finished_run_trains_nothing(killed_run, airflow_home):
    rd = killed_run["run_dir"]
    events_before = read_events(rd)
    again = dags_test(airflow_home, "relay_t", {"run": "killed"})
    assert again.returncode == 0, again.stdout[-3000:]
    assert "nothing to train" in again.stdout and "already published" in again.stdout
    assert read_events(rd) == events_before, "no job ran, nothing was published again"
    assert [r["step"] for r in read_metrics(rd)] == list(range(1, STEPS + 1))


def test_checkpoints_that_skipped_the_gate_are_validated_before_publication(airflow_home, spec_path):
    """A job stopped just after its commit, or a run trained with `relay train`, leaves checkpoints
    that no gate saw: a DAG run that finds the chunks done validates them before publishing them."""
    rd = run_dir(spec_path, "outside")
    trained = relay_cli("train", str(spec_path), "--to-step", str(STEPS), "--run", "outside", "--offline")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert not (rd / "global_step_12" / "relay_manifest.json").exists()
    r = dags_test(airflow_home, "relay_t", {"run": "outside"})
    assert r.returncode == 0, r.stdout[-3000:]
    assert "nothing to train" in r.stdout and "checkpoint valid" in r.stdout
    assert (rd / "global_step_12" / "relay_manifest.json").is_file()
    spec = load_spec(spec_path, check_environment=False)
    assert [m.step for m in store_for_spec(spec).published("outside")] == [12], "step 6 was never saved"


def test_unconfirmed_fresh_start_is_refused_and_keeps_checkpoints(airflow_home, spec_path):
    rd = run_dir(spec_path, "keep")
    rd.mkdir(parents=True)
    (rd / "global_step_6").mkdir()
    layout.write_tracker(rd, 6)
    r = dags_test(airflow_home, "relay_t", {"run": "keep", "fresh_start": True})
    assert r.returncode != 0
    assert "fresh start of run 'keep' refused" in r.stdout
    assert (rd / "global_step_6").is_dir() and layout.read_tracker(rd) == 6


def test_bad_environment_is_refused_before_any_job(airflow_home, ray_address):
    spec = write_spec(airflow_home["runs"], name="toolong", total_steps=100, chunk_steps=50)
    r = dags_test(airflow_home, "relay_toolong", {})
    assert r.returncode != 0
    assert "key 'total_steps'" in r.stdout and "cannot supply 100 steps" in r.stdout
    assert not RayJobs(ray_address).live_jobs_of_run("toolong", "toolong")
    assert not run_dir(spec, "toolong").exists()


@pytest.mark.fault
def test_the_demo_run_trains_warm_and_a_kill_in_a_warm_chunk_resumes_cold(
    airflow_home, ray_address, s3_server, tmp_path, fault_row
):
    """The demo's run (its spec's 60 steps in 3 warm chunks of 20) with the demo's crash drill, which kills the trainer
    after step 30: chunk 1's job goes on warm into chunk 2, the kill fails that attempt, and chunk 2's train task
    starts a new job from checkpoint 20, which goes on warm into chunk 3, whose train task admits and takes it over.
    Every chunk is validated and published as a cold one is (the validation where the checkpoint lives, as a Ray job
    of its own: checkpoints.validate_on ray), the run ends bitwise equal to an uninterrupted one, and the demo says of
    it what docs/quickstart.md shows (tests/support/demo_transcript.py)."""
    from relay.devstack import demo
    from support import demo_transcript

    shape = {"total_steps": 60, "chunk_steps": 20}
    spec_path = write_spec(
        airflow_home["runs"],
        name="demo",
        **shape,
        **{
            "chunks.handoff": "warm",
            "airflow.approvals": False,
            "checkpoints.validate_on": "ray",
            "checkpoints.hf_export": True,
        },
    )
    spec = load_spec(spec_path, check_environment=False)
    run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"  # named as the demo names its run
    rd = run_dir(spec_path, run)
    fault, kill_at = demo.drill(spec)
    t0 = time.time()
    r = dags_test(airflow_home, "relay_demo", {"run": run, "relay_fault": fault})
    assert r.returncode == 0, r.stdout[-5000:]
    validated = [j for j in jobs_of_run(ray_address, run, t0) if (j.metadata or {}).get("relay_role") == "validate"]
    assert [str(j.status) for j in validated] == ["SUCCEEDED"] * 3, "each chunk's checkpoint validated on the cluster"
    assert "checkpoint valid" in r.stdout and "✔ numerics" in r.stdout
    starts = [e for e in read_events(rd) if e["event"] == "chunk_start"]
    assert [(e["chunk"], e["resumed_from"], e["warm"]) for e in starts] == [
        (1, 0, False),
        (2, 20, True),
        (2, 20, False),
        (3, 40, True),
    ], "chunk 2 starts warm in chunk 1's job; after the kill a new job resumes it cold and goes on warm into chunk 3"
    assert starts[0]["attempt"] == starts[1]["attempt"] != starts[2]["attempt"] == starts[3]["attempt"]
    assert "went on warm into chunk 2" in r.stdout and "admitted and took over Ray job" in r.stdout
    assert layout.read_tracker(rd) == 60
    assert [row["step"] for row in read_metrics(rd)] == list(range(1, 61))
    retrained = [row["step"] for row in read_jsonl(rd / SUPERSEDED)]
    assert retrained == list(range(21, kill_at + 1)), "only the killed warm chunk's steps after checkpoint 20"
    straight = tmp_path / "straight"
    train(write_spec(tmp_path, name="demo", **shape), straight, 60)
    assert_bitwise_equal(model_state(rd / "global_step_60"), model_state(straight / "global_step_60"))
    store = store_for_spec(spec)
    assert [m.step for m in store.published(run)] == [20, 40, 60], "each chunk validated and published"
    g = goodput.ledger(rd)
    assert g is not None and [(a.chunk, a.warm, a.outcome) for a in g.attempts] == [
        (1, False, "finished"),
        (2, True, "killed"),
        (2, False, "finished"),
        (3, True, "finished"),
    ]
    assert [a.parts.get("startup", 0) > 0 for a in g.attempts] == [True, False, True, False], (
        "start-up only in chunk 1 and after the failure"
    )
    resumed, told = demo.resumed_chunk_2(Run.of(spec, run), kill_at)
    assert resumed, told
    said = [demo.drill_notice(spec, kill_at), *demo.summary(Run.of(spec, run), "success", s3_server), told]
    demo_transcript.check_or_record(
        demo_transcript.recorded(
            said, checkpoint_dir=rd.parent, s3_uri=spec.s3.uri if spec.s3 else "", s3_endpoint=s3_server
        )
    )
    fault_row(
        case="warm-chunk-kill",
        layer="full stack (Airflow, Ray, S3)",
        fault=f"the demo's drill: the trainer is killed after step {kill_at}, in chunk 2, which chunk 1's job went on "
        "into warm",
        action="chunk 2's attempt failed; a new job resumed it cold from checkpoint 20 (rows 21.. of the warm job kept "
        "in metrics.superseded.jsonl) and went on warm into chunk 3",
        steps_lost=len(retrained),
        run_dir=rd,
        store=store,
    )


def test_a_source_changed_under_a_warm_run_stops_the_next_chunk_and_its_job_without_a_commit(
    airflow_home, ray_address, tmp_path
):
    """A row is appended to the training data while chunk 1 trains (data.on_source_change: fail): chunk 2's train task
    refuses to start it, saying what changed and what to do, and alerts; the job that went on warm into chunk 2 stops
    without committing anything of it, and no new job runs for chunk 2."""
    import pyarrow.parquet as pq

    from relay.runs import handoff

    data = tmp_path / "train.parquet"
    shutil.copyfile(ROOT / "include" / "data" / "arith_train.parquet", data)
    spec_path = write_spec(
        airflow_home["runs"],
        name="warmrefused",
        chunk_steps=4,
        **{"chunks.handoff": "warm", "airflow.approvals": False, "data.train_files": [str(data)], "data.val_files": []},
    )
    rd = run_dir(spec_path, "refused")
    t0 = time.time()
    dag_test = start_dags_test(airflow_home, "relay_warmrefused", {"run": "refused"})
    deadline = time.time() + 600
    while time.time() < deadline and not any(e["event"] == "chunk_start" for e in _events(rd)):
        time.sleep(0.1)
    table = pq.read_table(data)
    rows = table.to_pylist()
    rows.append(dict(rows[0], extra_info={"split": "train", "index": 99999}))
    pq.write_table(table.from_pylist(rows, schema=table.schema), data)  # the source changed after its freeze
    returncode, out = dag_test.wait()
    assert returncode != 0, "the DAG run fails: chunk 2 was refused"
    assert "chunk 2/3 (steps 5..8) of run refused not started" in out, out[-5000:]
    assert "1 row(s) added (extra_info.index: 99999)" in out and "use_frozen" in out
    assert "[relay ERROR] refused: training data changed under the run (chunk 2)" in out, "alerted"
    assert "refused, it stops without committing" in out, out[-5000:]
    assert layout.read_tracker(rd) == 4 and not (rd / "global_step_8").exists(), "nothing of chunk 2 committed"
    refused = [e for e in read_events(rd) if e["event"] == "handoff_refused"]
    assert len(refused) == 1 and refused[0]["chunk"] == 2 and "it was refused" in refused[0]["why"], refused
    record = handoff.warm(rd, 2)
    assert record is not None and handoff.answer(rd, 2, record["attempt"])["admitted"] is False
    jobs = RayJobs(ray_address)
    deadline = time.time() + 60
    while jobs.live_jobs_of_run("warmrefused", "refused") and time.time() < deadline:
        time.sleep(0.5)
    assert jobs.get(record["attempt"]).status == "FAILED", "the warm job ended (exit 4: stopped without a commit)"
    started = {(j.metadata or {}).get("relay_chunk") for j in jobs_of_run(ray_address, "refused", t0)}
    assert started == {"1"}, "no job was started for chunk 2"


def _events(run_dir: Path) -> list[dict]:
    return read_events(run_dir) if (run_dir / "events.jsonl").exists() else []
