"""Secrets come only from Airflow connections and environment variables, and never leave as text: a
planted secret (a connection's password, an environment variable that a spec's ray.env_vars names)
is looked for in the chunk request, task logs, alert payloads, e-mails, the alert ledger and the run
report, and found nowhere; where an error carried it, *** stands in its place."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from relay.common import files, redaction
from relay.runs import layout
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from support.helpers import ROOT, dags_test, write_spec
from support.polling import wait_for
from support.receivers import MailSink

TOKEN = f"tok-{uuid.uuid4().hex}"  # an environment variable's value, used by ray.env_vars
PASSWORD = f"pw-{uuid.uuid4().hex}"  # an Airflow connection's password


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("RELAY_TEST_TOKEN", TOKEN)
    return {"RELAY_TEST_TOKEN": TOKEN}


def test_ray_env_vars_are_expanded_only_when_a_job_is_submitted(tmp_path, secret_env, monkeypatch):
    from relay.common.errors import RayJobError
    from relay.jobs.ray_jobs import job_env_vars, runtime_env
    from relay.trainers.contract import ChunkRequest

    spec = load_spec(
        write_spec(
            tmp_path,
            **{"ray.env_vars": {"HF_TOKEN": "${RELAY_TEST_TOKEN}", "MODE": "plain", "LEVEL": "${RELAY_UNSET_LEVEL:-info}"}},
        ),
        check_environment=False,
    )
    req = ChunkRequest(run=Run.of(spec, "r"), to_step=6)
    env = runtime_env(req)["env_vars"]
    assert (env["HF_TOKEN"], env["MODE"], env["LEVEL"]) == (TOKEN, "plain", "info")
    # The secret is in the job's environment only: not in the spec, the chunk request or the fingerprint.
    for text in (spec.to_json(), req.to_json(), env["RELAY_CHUNK_REQUEST"], json.dumps(spec.resume_critical())):
        assert TOKEN not in text
    assert "${RELAY_TEST_TOKEN}" in req.to_json()
    assert TOKEN in redaction.registered() and redaction.redact(f"x{TOKEN}y") == "x***y"
    monkeypatch.delenv("RELAY_TEST_TOKEN")
    with pytest.raises(RayJobError) as e:
        job_env_vars(spec)
    assert "ray.env_vars.HF_TOKEN" in e.value.what and "RELAY_TEST_TOKEN" in e.value.what and e.value.fix


def _context(run_id: str, task_id: str = "chunk_01.train"):
    ti = SimpleNamespace(
        dag_id="relay_t",
        task_id=task_id,
        try_number=1,
        max_tries=2,
        log_url="http://127.0.0.1/x",
        xcom_pull=lambda **kw: None,
    )
    return {"ti": ti, "dag_run": SimpleNamespace(run_id=run_id, conf={}), "params": {}}


def test_alerts_and_their_ledger_redact_connection_and_environment_secrets(
    tmp_path, receivers, secret_env, monkeypatch, caplog
):
    from airflow.sdk import BaseHook

    from relay.airflow.notifiers import send_once
    from relay.alerts import Alert

    for k, v in receivers["env"].items():
        monkeypatch.setenv(k, v)
    http = receivers["http"]
    monkeypatch.setenv(
        "AIRFLOW_CONN_RELAY_SECRET_WEBHOOK",
        json.dumps(
            {
                "conn_type": "http",
                "host": f"http://127.0.0.1:{http.port}/secret-alerts",
                "login": "relay",
                "password": PASSWORD,
            }
        ),
    )
    receivers["mail"].messages.clear()
    http.posts.clear()
    spec = load_spec(
        write_spec(
            tmp_path,
            **{
                "ray.env_vars": {"HF_TOKEN": "${RELAY_TEST_TOKEN}"},
                "alerts.email": ["oncall@example.com"],
                "alerts.smtp_conn_id": "relay_smtp",
                "alerts.webhook_conn_id": "relay_secret_webhook",
            },
        ),
        check_environment=False,
    )
    spec.run_dir("r").mkdir(parents=True)
    BaseHook.get_connection("relay_secret_webhook")  # the task used the connection: Airflow masks its password
    leaky = f"HTTP 401 from https://relay:{PASSWORD}@hooks.example.com with HF_TOKEN={TOKEN}"
    alert = Alert(
        kind="chunk_failed",
        run="r",
        what=f"chunk failed: {leaky}",
        details=f"last lines:\n{leaky}",
        action="retried",
        dag_run="manual__1",
        task="chunk_01.train",
        try_number=1,
    )
    with caplog.at_level("INFO"):
        assert send_once(_context("manual__1"), Run.of(spec, "r"), alert, "manual__1|chunk_01.train|chunk_failed")
    wait_for(
        lambda: len(receivers["mail"].messages) == 1 and http.at("/secret-alerts"), 10, "the alert by e-mail and webhook"
    )
    payload = json.dumps(http.at("/secret-alerts")[0])
    mail = MailSink.html(receivers["mail"].messages[0]) + str(receivers["mail"].messages[0])
    ledger = layout.relay_dir(spec.run_dir("r"), "alerts.json").read_text()
    for where, text in (("webhook payload", payload), ("e-mail", mail), ("ledger", ledger), ("log", caplog.text)):
        assert TOKEN not in text and PASSWORD not in text, f"a secret in the {where}"
    assert "relay:***@hooks.example.com" in payload and "HF_TOKEN=***" in payload


def test_the_run_report_holds_no_secret(tmp_path, secret_env):
    from relay.insights import report

    load_spec(write_spec(tmp_path, **{"ray.env_vars": {"HF_TOKEN": "${RELAY_TEST_TOKEN}"}}), check_environment=False)
    run_dir = tmp_path / "ckpt" / "r"
    run_dir.mkdir(parents=True)
    rows = [
        {
            "step": s,
            "chunk": 1,
            "attempt": "a",
            "seconds": 0.1,
            "time": 1e9 + s,
            "reward_mean": 0.1 * s,
            "loss": 1.0,
            "kl": 0.0,
            "lr": 1e-3,
        }
        for s in range(1, 4)
    ]
    (run_dir / layout.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    events = [
        {"event": "chunk_start", "chunk": 1, "attempt": "a", "resumed_from": 0, "to_step": 3, "time": 1e9},
        {
            "event": "quarantine",
            "step": 2,
            "check": "integrity",
            "time": 1e9 + 2,
            "detail": f"download failed: token={TOKEN}",
        },
        {"event": "chunk_end", "chunk": 1, "attempt": "a", "end_step": 3, "time": 1e9 + 3},
    ]
    (run_dir / layout.EVENTS).write_text("".join(json.dumps(e) + "\n" for e in events))
    files.atomic_write_json(
        layout.relay_dir(run_dir, "run.json"),
        {
            "drift": [
                {
                    "at": "2026-01-01T00:00:00Z",
                    "by": "someone",
                    "changes": [{"key": "ray.env_vars", "was": "x", "now": f"HF_TOKEN={TOKEN}"}],
                }
            ]
        },
    )
    rep = report.build(run_dir)
    paths = report.write(rep, tmp_path / "report")
    html = paths["html"].read_text()
    assert TOKEN not in html and TOKEN not in rep.summary().replace(TOKEN, "") and "***" in html


@pytest.fixture
def sinks(receivers):
    receivers["mail"].messages.clear()
    receivers["http"].posts.clear()
    return receivers


@pytest.mark.services
def test_a_secret_in_a_failing_tasks_error_is_masked_in_its_log_and_alerts(airflow_home, sinks, tmp_path):
    """A real DAG run (`airflow dags test`): preflight.data fails, and its error carries a value equal to the
    secret that the spec's ray.env_vars names (the observed values of a failed expectation). The task log,
    the alert's webhook post and e-mail, and the ledger all show *** instead."""
    table = pq.read_table(ROOT / "include" / "data" / "arith_train.parquet")
    rows = table.to_pylist()
    rows[0]["data_source"] = TOKEN
    data = tmp_path / "prompts.parquet"
    pq.write_table(table.from_pylist(rows, schema=table.schema), data)
    suite = tmp_path / "sources.yaml"
    suite.write_text(
        f"- type: expect_column_distinct_values_to_be_in_set\n"
        f"  kwargs: {{column: data_source, value_set: [{rows[1]['data_source']}]}}\n"
        f"  meaning: one known source\n"
    )
    spec_path = write_spec(
        airflow_home["runs"],
        name="ssecret",
        **{
            "data.train_files": [str(data)],
            "data.val_files": [],
            "data.expectations": [str(suite)],
            "ray.env_vars": {"HF_TOKEN": "${RELAY_TEST_TOKEN}"},
            "alerts.email": ["oncall@example.com"],
            "alerts.smtp_conn_id": "relay_smtp",
            "alerts.webhook_conn_id": "relay_webhook",
        },
    )
    r = dags_test(airflow_home, "relay_ssecret", {}, env={**sinks["env"], "RELAY_TEST_TOKEN": TOKEN})
    assert r.returncode != 0
    wait_for(
        lambda: len(sinks["mail"].messages) == 1 and sinks["http"].at("/alerts"),
        10,
        lambda: f"the alert by e-mail and webhook:\n{r.stdout[-3000:]}",
    )
    post = sinks["http"].at("/alerts")[0]
    assert post["task"] == "preflight.data" and "***" in post["details"], post
    texts = {
        "dags test output": r.stdout + r.stderr,
        "webhook": json.dumps(post),
        "e-mail": MailSink.html(sinks["mail"].messages[0]),
    }
    logs = Path(airflow_home["home"]) / "logs"
    texts.update(
        {str(p): p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file() and "relay_ssecret" in str(p)}
    )
    run_dir = load_spec(spec_path, check_environment=False).run_dir("ssecret")
    for p in run_dir.rglob("*.json*"):
        texts[str(p)] = p.read_text(errors="replace")
    leaks = [where for where, text in texts.items() if TOKEN in text]
    lines = [line[:300] for where, text in texts.items() for line in text.splitlines() if TOKEN in line][:10]
    assert not leaks, f"the secret is in: {leaks}:\n" + "\n".join(lines)
