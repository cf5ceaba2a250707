"""The trigger form's fields and its refusals in plain words (relay.airflow.form), without Airflow."""

from relay.airflow import form
from relay.spec.run_spec import load_spec
from support.helpers import write_spec


def spec(tmp_path, **overrides):
    return load_spec(write_spec(tmp_path, name="demo", **overrides), check_environment=False)


def test_every_field_may_be_left_empty_as_the_ui_sends_it(tmp_path):
    s = spec(tmp_path)
    assert all("null" in f["type"] for f in form.fields(s).values())
    empty = {name: None for name in form.fields(s)}  # what Airflow's form sends for untouched/cleared fields
    assert form.explain(s, empty) == []
    assert form.explain(s, {"run": "", "allow_drift": [""], "alert_emails": ["", "a@b.c"]}) == []


def test_the_channels_are_those_the_spec_configures(tmp_path):
    assert form.configured_channels(spec(tmp_path)) == ["email"]
    both = spec(tmp_path, **{"alerts.webhook_conn_id": "hook"})
    assert form.fields(both)["alert_channels"]["default"] == ["email", "webhook"]
    none = spec(tmp_path, **{"alerts.email": []})
    assert form.fields(none)["alert_channels"]["default"] is None
    assert "configures no alert channel" in form.explain(none, {"alert_channels": ["email"]})[0]


def test_refusals_say_what_is_wrong_and_give_an_example(tmp_path):
    s = spec(tmp_path)
    (run,) = form.explain(s, {"run": "../x"})
    assert run.startswith("Run: '../x' is not a run name") and "e.g. 'demo-2'" in run
    assert "^" not in run and "schema" not in run, "no regex, no schema dump"
    (fresh,) = form.explain(s, {"fresh_start": "yes"})
    assert fresh == "Fresh start: 'yes' is not true or false, e.g. false"
    (channel,) = form.explain(s, {"alert_channels": ["pager"]})
    assert "'pager' is not a channel that spec demo configures; choose among email" in channel
    (mail,) = form.explain(s, {"alert_emails": ["ml-platform"]})
    assert "'ml-platform' is not an e-mail address" in mail
    assert len(form.explain(s, {"run": "a..b", "fresh_start": 1})) == 2


def test_the_fresh_start_help_says_where_an_unconfirmed_one_waits(tmp_path):
    """Without Confirm fresh start, a run with checkpoints waits for a person on the task's Required Actions page
    (approvals on, the default), or is refused (approvals off): the form's help says which, and where."""
    asking = form.fields(load_spec(write_spec(tmp_path, name="asks"), check_environment=False))
    help_text = asking["fresh_start"]["description"]
    assert "Required Actions page" in help_text and "preflight.run" in help_text, help_text
    assert "also needs Confirm fresh start" not in help_text
    refusing = form.fields(
        load_spec(write_spec(tmp_path, name="refuses", **{"airflow.approvals": False}), check_environment=False)
    )
    assert "refused" in refusing["fresh_start"]["description"]
