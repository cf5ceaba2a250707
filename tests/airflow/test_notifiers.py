"""Alert channels through Airflow's provider hooks, against a real SMTP server and HTTP receiver."""

import pytest
from core.test_alerts import an_alert

from relay.airflow.notifiers import Channels, deliver
from support.receivers import MailSink, wait_for


@pytest.fixture
def conns(receivers, monkeypatch):
    for k, v in receivers["env"].items():
        monkeypatch.setenv(k, v)
    receivers["mail"].messages.clear()
    receivers["http"].posts.clear()
    return receivers


def test_an_alert_reaches_email_slack_and_the_webhook(conns):
    alert = an_alert()
    results = deliver(alert, Channels(("oncall@example.com", "ml@example.com"), "relay_smtp", "relay_slack",
                                      "relay_webhook"))
    assert results == {"email:relay_smtp": "sent", "slack:relay_slack": "sent", "webhook:relay_webhook": "sent"}
    mail, http = conns["mail"], conns["http"]
    assert wait_for(lambda: len(mail.messages) == 1)
    msg = mail.messages[0]
    assert msg["Subject"] == alert.subject() and msg["X-Relay-Alert"] == "checkpoint_invalid"
    assert msg["X-Envelope-To"] == "oncall@example.com, ml@example.com"
    assert "s3://relay/runs/r1/global_step_6" in MailSink.html(msg)
    assert http.at("/alerts") == [alert.payload()]
    slack = http.at("/slack/T0/B0/s3cr3t")
    assert len(slack) == 1 and slack[0]["text"] == alert.subject() and slack[0]["blocks"][0]["type"] == "header"


def test_a_broken_channel_is_reported_and_never_raises(conns):
    results = deliver(an_alert(), Channels(("oncall@example.com",), "relay_smtp", None, "relay_broken_webhook"))
    assert results["email:relay_smtp"] == "sent"
    assert results["webhook:relay_broken_webhook"].startswith("failed: ConnectionError")
    assert wait_for(lambda: len(conns["mail"].messages) == 1)


def test_no_channel_sends_nothing():
    assert deliver(an_alert(), Channels((), "smtp_default", None, None)) == {}


@pytest.mark.parametrize("event", [None, {}, {"message": "lost"}, {"status": "SUCCEEDED"}, "SUCCEEDED"])
def test_a_trigger_event_without_its_fields_is_an_error_that_says_so(event):
    from airflow.sdk.exceptions import AirflowException

    from relay.airflow.operators import event_status

    with pytest.raises(AirflowException, match="has no status or no submission_id; clear the task to run it again"):
        event_status(event, "chunk 2/2 (steps 7..12) of run r", "submission_id")
    assert event_status({"status": "STALLED", "submission_id": "j"}, "chunk 2", "submission_id") == "STALLED"
