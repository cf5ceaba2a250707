"""Alert channels through Airflow's provider hooks, against a real SMTP server and HTTP receiver."""

import pytest

from support.alerts import an_alert
from support.polling import wait_for
from support.receivers import MailSink

pytestmark = pytest.mark.services  # Airflow's own processes or DAG runs, on the session's Ray head and S3
# (Airflow is imported by the tests, not at collection: every worker of the fast lane collects this module)


@pytest.fixture
def conns(receivers, monkeypatch):
    for k, v in receivers["env"].items():
        monkeypatch.setenv(k, v)
    receivers["mail"].messages.clear()
    receivers["http"].posts.clear()
    return receivers


def test_an_alert_reaches_email_slack_and_the_webhook(conns):
    from relay.airflow.notifiers import Channels, deliver

    alert = an_alert()
    results = deliver(
        alert, Channels(("oncall@example.com", "ml@example.com"), "relay_smtp", "relay_slack", "relay_webhook")
    )
    assert results == {"email:relay_smtp": "sent", "slack:relay_slack": "sent", "webhook:relay_webhook": "sent"}
    mail, http = conns["mail"], conns["http"]
    wait_for(lambda: len(mail.messages) == 1, 10, "the alert's e-mail")
    msg = mail.messages[0]
    assert msg["Subject"] == alert.subject() and msg["X-Relay-Alert"] == "checkpoint_invalid"
    assert msg["X-Envelope-To"] == "oncall@example.com, ml@example.com"
    assert "s3://relay/runs/r1/global_step_6" in MailSink.html(msg)
    assert http.at("/alerts") == [alert.payload()]
    slack = http.at("/slack/T0/B0/s3cr3t")
    assert len(slack) == 1 and slack[0]["text"] == alert.subject() and slack[0]["blocks"][0]["type"] == "header"


def test_a_broken_channel_is_reported_and_never_raises(conns):
    from relay.airflow.notifiers import Channels, deliver

    results = deliver(an_alert(), Channels(("oncall@example.com",), "relay_smtp", None, "relay_broken_webhook"))
    assert results["email:relay_smtp"] == "sent"
    assert results["webhook:relay_broken_webhook"].startswith("failed: ConnectionError")
    wait_for(lambda: len(conns["mail"].messages) == 1, 10, "the alert's e-mail")


def test_no_channel_sends_nothing():
    from relay.airflow.notifiers import Channels, deliver

    assert deliver(an_alert(), Channels((), "smtp_default", None, None)) == {}


@pytest.mark.parametrize("event", [None, {}, {"message": "lost"}, {"status": "SUCCEEDED"}, "SUCCEEDED"])
def test_a_trigger_event_without_its_fields_is_an_error_that_says_so(event):
    from airflow.sdk.exceptions import AirflowException

    from relay.airflow.operators import event_status

    with pytest.raises(AirflowException, match="has no status or no submission_id; clear the task to run it again"):
        event_status(event, "chunk 2/2 (steps 7..12) of run r", "submission_id")
    assert event_status({"status": "STALLED", "submission_id": "j"}, "chunk 2", "submission_id") == "STALLED"


def test_an_unconfigured_channel_is_one_warning_per_run_not_an_error_per_alert(tmp_path, caplog):
    """A spec names a channel whose Airflow connection does not exist (the e-mail channel on a deployment without
    smtp_default): the run's first alert says so in one WARNING naming it and what to do; no alert logs an ERROR."""
    import logging

    from relay.airflow.notifiers import send_once
    from relay.runs.run import Run
    from relay.spec.run_spec import load_spec
    from support.helpers import write_spec

    spec = load_spec(
        write_spec(
            tmp_path, name="quiet", **{"alerts.email": ["oncall@example.com"], "alerts.smtp_conn_id": "no_such_smtp"}
        ),
        check_environment=False,
    )
    run = Run.of(spec, "quiet")
    run.dir.mkdir(parents=True)
    caplog.set_level(logging.INFO, logger="relay.airflow.notifiers")
    for n in range(3):
        send_once({"params": {}}, run, an_alert(), f"event-{n}")
    said = [r for r in caplog.records if "not configured" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]
    assert "email:no_smtp" not in said[0].getMessage() and "email:no_such_smtp" in said[0].getMessage()
    assert "once per run" in said[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "no ERROR for a missing connection"


def test_the_local_stacks_mail_sink_keeps_each_alert_as_a_file(tmp_path, monkeypatch):
    from relay.airflow.notifiers import Channels, deliver

    """`relay stack up` points smtp_default at its mail sink: an alert e-mail lands in its folder as a .eml file."""
    import email
    import email.policy
    import json
    import subprocess
    import sys

    from support.helpers import ROOT
    from support.ports import free_port

    port, folder = free_port(), tmp_path / "mail"
    sink = subprocess.Popen(
        [sys.executable, "-m", "relay.devstack.mailsink", "--port", str(port), "--dir", str(folder)], cwd=ROOT
    )
    try:
        monkeypatch.setenv(
            "AIRFLOW_CONN_LOCAL_MAIL",
            json.dumps(
                {
                    "conn_type": "smtp",
                    "host": "127.0.0.1",
                    "port": port,
                    "extra": {"from_email": "relay@localhost", "disable_ssl": True, "disable_tls": True},
                }
            ),
        )
        alert = an_alert()
        wait_for(
            lambda: deliver(alert, Channels(("oncall@example.com",), "local_mail", None, None))
            == {"email:local_mail": "sent"},
            30,
            "the mail sink to accept the alert",
        )
        wait_for(lambda: list(folder.glob("*.eml")), 10, f"the alert's .eml in {folder}")
        [eml] = folder.glob("*.eml")
        msg = email.message_from_bytes(eml.read_bytes(), policy=email.policy.default)
        assert msg["Subject"] == alert.subject() and msg["X-Envelope-To"] == "oncall@example.com"
    finally:
        sink.terminate()
        sink.wait(10)
