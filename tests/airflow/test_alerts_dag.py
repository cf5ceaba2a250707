"""Alerts from real DAG runs (`airflow dags test`) to a real SMTP server (aiosmtpd) and a real HTTP
receiver on 127.0.0.1: one alert per failure event, with the facts a person needs to act on it."""

import os
import signal
import time
from urllib.parse import quote

import pyarrow.parquet as pq
import pytest

from relay.runs import layout
from relay.runs.lease import Lease
from relay.runs.metrics import read_events
from relay.s3.store import store_for_spec
from relay.spec.run_spec import load_spec
from support.helpers import ROOT, dags_test, read_metrics, relay_cli, start_dags_test, write_spec
from support.polling import wait_for
from support.receivers import MailSink

pytestmark = pytest.mark.services  # Airflow's own processes or DAG runs, on the session's Ray head and S3

ALL_CHANNELS = {
    "alerts.email": ["oncall@example.com"],
    "alerts.smtp_conn_id": "relay_smtp",
    "alerts.webhook_conn_id": "relay_webhook",
    "alerts.slack_conn_id": "relay_slack",
}


@pytest.fixture
def sinks(receivers):
    receivers["mail"].messages.clear()
    receivers["http"].posts.clear()
    return receivers


def settled(sinks, emails: int) -> None:
    """Wait for the expected e-mails, then a moment more: an extra alert would arrive now."""
    wait_for(
        lambda: len(sinks["mail"].messages) >= emails,
        10,
        lambda: f"{emails} e-mails; arrived: {[m['Subject'] for m in sinks['mail'].messages]}",
    )
    time.sleep(1)


def flip_a_byte_in_the_middle(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_corrupted_checkpoint_sends_exactly_one_email_and_one_webhook_post(airflow_home, sinks):
    spec_path = write_spec(airflow_home["runs"], name="acorrupt", **ALL_CHANNELS)
    spec = load_spec(spec_path, check_environment=False)
    rd = spec.run_dir("c")
    # Step 6 trained, validated and published; step 12 trained with no gate yet, then damaged on disk.
    for args in (
        ("train", str(spec_path), "--to-step", "6", "--run", "c", "--offline"),
        ("checkpoint", "publish", str(rd), spec.s3.uri, "--run", "c", "--step", "6"),
        ("train", str(spec_path), "--to-step", "12", "--run", "c", "--offline"),
    ):
        r = relay_cli(*args)
        assert r.returncode == 0, r.stderr[-3000:]
    flip_a_byte_in_the_middle(rd / "global_step_12" / "actor" / layout.shard_name("model", 1, 0))

    r = dags_test(airflow_home, "relay_acorrupt", {"run": "c"}, env=sinks["env"])
    assert r.returncode != 0
    settled(sinks, emails=1)
    mail, posts = sinks["mail"].messages, sinks["http"].at("/alerts")
    assert len(mail) == 1 and len(posts) == 1, ([m["Subject"] for m in mail], posts)
    assert len(sinks["http"].at("/slack/")) == 1

    alert = posts[0]
    assert alert["kind"] == "checkpoint_invalid" and alert["severity"] == "error"
    assert (alert["run"], alert["dag_id"], alert["chunk"], alert["step"]) == ("c", "relay_acorrupt", 2, 12)
    assert alert["dag_run"].startswith("manual__") and alert["task"] == "chunk_02.validate"
    assert alert["what"].startswith("checkpoint step 12 failed the ")
    assert "✘" in alert["details"], "the check report travels with the alert"
    assert (alert["last_valid_step"], alert["last_valid_uri"]) == (6, store_for_spec(spec).step_uri("c", 6))
    assert alert["quarantined_to"].startswith(str(rd / ".relay" / "quarantine"))
    assert "quarantined it (never published)" in alert["action"] and "step 6" in alert["action"]
    assert f"/dags/relay_acorrupt/runs/{quote(alert['dag_run'])}/tasks/chunk_02.validate" in alert["log_url"]

    msg = mail[0]
    assert msg["Subject"] == "[relay ERROR] c: checkpoint failed validation (chunk 2, step 12)"
    body = MailSink.html(msg)
    for fact in (alert["dag_run"], alert["last_valid_uri"], alert["quarantined_to"], "chunk_02.validate"):
        assert fact in body
    assert layout.read_tracker(rd) == 6, "the tracker fell back to the last valid checkpoint"


def test_a_data_failure_alerts_with_the_failed_expectations(airflow_home, sinks, tmp_path):
    table = pq.read_table(ROOT / "include" / "data" / "arith_train.parquet")
    rows = table.to_pylist()
    rows[3]["reward_model"]["ground_truth"] = None
    bad = tmp_path / "prompts.parquet"
    pq.write_table(table.from_pylist(rows, schema=table.schema), bad)
    write_spec(airflow_home["runs"], name="adata", **{"data.train_files": [str(bad)], "data.val_files": [], **ALL_CHANNELS})

    r = dags_test(airflow_home, "relay_adata", {}, env=sinks["env"])
    assert r.returncode != 0
    settled(sinks, emails=1)
    posts = sinks["http"].at("/alerts")
    assert len(sinks["mail"].messages) == 1 and len(posts) == 1
    alert = posts[0]
    assert alert["kind"] == "data_quality" and alert["task"] == "preflight.data"
    assert "expect_column_values_to_not_be_null on reward_model.ground_truth" in alert["details"]
    assert "extra_info.index" in alert["details"], "with the rows that failed"
    assert "nothing was frozen" in alert["action"] or "nothing was frozen" in alert["what"]
    assert "expect_column_values_to_not_be_null" in MailSink.html(sinks["mail"].messages[0])


def test_a_stalled_chunk_alerts_and_is_retried_and_a_broken_webhook_does_not_fail_the_run(airflow_home, sinks, ray_address):
    spec_path = write_spec(
        airflow_home["runs"],
        name="astall",
        **{
            "alerts.email": ["oncall@example.com"],
            "alerts.smtp_conn_id": "relay_smtp",
            "alerts.webhook_conn_id": "relay_broken_webhook",
            "alerts.stall_minutes": 0.1,
            "alerts.startup_minutes": 3,
            "alerts.on_finish": True,
        },
    )
    rd = load_spec(spec_path, check_environment=False).run_dir("astall")
    dag_test = start_dags_test(airflow_home, "relay_astall", {}, env=sinks["env"])
    deadline = time.time() + 600
    while time.time() < deadline:
        if (rd / "metrics.jsonl").exists() and max([r["step"] for r in read_metrics(rd)] or [0]) >= 8:
            os.kill(Lease(rd).current()["pid"], signal.SIGSTOP)  # a hung rollout: alive, no new step
            break
        time.sleep(0.05)
    rc, out = dag_test.wait()
    assert rc == 0, out[-5000:]
    settled(sinks, emails=3)
    subjects = [m["Subject"] for m in sinks["mail"].messages]
    assert len(subjects) == 3, subjects
    assert subjects[0].startswith("[relay ERROR] astall: chunk stalled: no new step (chunk 2, step "), subjects
    assert subjects[1] == "[relay OK] astall: run recovered (chunk 2, step 12)"
    stall = MailSink.html(sinks["mail"].messages[0])
    assert "no new step for" in stall and "stopped Ray job" in stall and "resumes from step 6" in stall
    assert "stall" in MailSink.html(sinks["mail"].messages[1]), "the recovery names what it resolves"
    # alerts.on_finish: the run's end, with its goodput ledger; the stalled try is its one failure
    assert subjects[2] == "[relay OK] astall: run finished (step 12)"
    finished = MailSink.html(sinks["mail"].messages[2])
    assert "goodput " in finished and "where the wall time went:" in finished and "(stalled)" in finished
    assert "alert stall via webhook:relay_broken_webhook: failed" in out
    assert sinks["http"].posts == []
    assert [r["step"] for r in read_metrics(rd)] == list(range(1, 13)), "the retry resumed and finished the run"


def test_a_reward_function_that_raises_at_a_step_stops_after_two_tries_with_one_alert_naming_the_cause(
    airflow_home, sinks, ray_address, tmp_path
):
    """The same exception at the same step in two tries is deterministic: no third try, one alert that names
    the cause, the step, the evidence and what to do."""
    reward = tmp_path / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if extra_info['global_step'] == 5:\n"
        "        raise ValueError(f'cannot score row {extra_info[\"index\"]}: {ground_truth!r}')\n"
        "    return float(solution_str == ground_truth)\n"
    )
    spec_path = write_spec(
        airflow_home["runs"],
        name="areward",
        **{
            "alerts.email": ["oncall@example.com"],
            "alerts.smtp_conn_id": "relay_smtp",
            "alerts.webhook_conn_id": "relay_webhook",
            "airflow.retries": 2,
            "airflow.retry_delay_seconds": 1,
            "trainer.settings.custom_reward_function": {"path": str(reward)},
        },
    )
    rd = load_spec(spec_path, check_environment=False).run_dir("areward")

    r = dags_test(airflow_home, "relay_areward", {}, env=sinks["env"])
    assert r.returncode != 0
    settled(sinks, emails=1)
    posts = sinks["http"].at("/alerts")
    assert len(sinks["mail"].messages) == 1 and len(posts) == 1, posts
    alert = posts[0]
    assert (alert["kind"], alert["task"], alert["try_number"], alert["step"]) == ("chunk_failed", "chunk_01.train", 2, 5)
    assert alert["cause"].startswith("cause: exception at step 5, an exception in the training code")
    assert "ValueError: cannot score row" in alert["cause"]
    assert "reward.py" in alert["details"] and "the same exception at the same step" in alert["details"]
    assert "fix the reward function" in alert["action"]
    assert "Cause" in MailSink.html(sinks["mail"].messages[0])
    assert sinks["mail"].messages[0]["Subject"] == "[relay ERROR] areward: chunk failed; no more retries (chunk 1, step 5)"
    failed = [e for e in read_events(rd) if e["event"] == "chunk_failed"]
    assert [(e["try_number"], e["cause"], e["step"], e["policy"]) for e in failed] == [
        (1, "exception", 5, "retry"),
        (2, "exception", 5, "stop"),
    ], "two tries, the second stopped for good"
