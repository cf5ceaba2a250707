"""The trigger form of a run DAG: its fields, and a refused value explained in plain words.

The fields are JSON schemas (the DAG's Params are built from them, relay.airflow.dag_factory).
Airflow's UI marks a field required unless its type admits null, and sends null for a field left
empty, so every field here admits null: an empty field means its default, written in its
description. Airflow refuses a value outside a schema with jsonschema's own text (a regex and the
schema dumped); `explain` turns the same refusal into what is wrong and an example of a good value
(the API server shows it in the form through relay.airflow.api_plugin).

No Airflow import: the schemas are plain dicts, checked here with jsonschema.
"""

from __future__ import annotations

from typing import Any

import jsonschema

# `..` is refused too (spec.check_run_name): a run name becomes a folder and an S3 prefix.
RUN_NAME_SCHEMA_PATTERN = r"^$|^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # "": the spec's run
EMAIL_PATTERN = r"^$|^[^@\s]+@[^@\s]+$"  # a blank line of the text box is ignored (relay.airflow.notifiers)
CHANNELS = ("email", "slack", "webhook")


def configured_channels(spec) -> list[str]:
    """The alert channels a spec configures: e-mail with addresses, Slack and webhook with a connection."""
    a = spec.alerts
    return [
        c
        for c, on in (("email", bool(a.email)), ("slack", bool(a.slack_conn_id)), ("webhook", bool(a.webhook_conn_id)))
        if on
    ]


def fields(spec) -> dict[str, dict[str, Any]]:
    """name -> {"default": value, **JSON schema with title and description}, in the form's order."""
    channels = configured_channels(spec)
    if channels:
        channel_items = {"type": "string", "enum": channels}
        channel_extra: dict[str, Any] = {"examples": channels}  # a multi-select of exactly these
    else:
        channel_items, channel_extra = {"type": "string"}, {"maxItems": 0}
    return {
        "run": {
            "default": None,
            "type": ["null", "string"],
            "pattern": RUN_NAME_SCHEMA_PATTERN,
            "title": "Run",
            "description": f"The training run to continue or start. Empty: the spec's run, '{spec.name}'"
            + (" (a scheduled spec: '<name>-<logical date>')" if spec.airflow.schedule else "")
            + ". An existing run continues from its latest valid checkpoint; finished chunks are "
            "not trained again.",
        },
        "fresh_start": {
            "default": False,
            "type": ["boolean", "null"],
            "title": "Fresh start",
            "description": "Start the run again from step 0, as a new incarnation; its old checkpoints are moved to "
            "<checkpoint_dir>/.archive (and S3's .archive), never deleted. A run that has checkpoints "
            + (
                "waits for a person's approval first, on the preflight.run task's Required Actions "
                "page (the task asks there and alerts with the link), unless Confirm fresh start names "
                "it."
                if spec.airflow.approvals
                else "also needs Confirm fresh start: without it, the DAG run is refused."
            )
            + " Refused while a trainer or Ray job of the run still runs.",
        },
        "confirm_fresh_start": {
            "default": None,
            "type": ["null", "string"],
            "title": "Confirm fresh start",
            "description": "Only with Fresh start on, for a run that has checkpoints: type the run's name. "
            "Ignored otherwise.",
        },
        "allow_drift": {
            "default": None,
            "type": ["null", "array"],
            "items": {"type": "string"},
            "title": "Allow drift",
            "description": "Resume-critical settings (dotted keys, one per line, e.g. trainer.settings.rollout_n) "
            "this DAG run may change on purpose; recorded in the run record with who and when. "
            "Empty: none.",
        },
        "alert_emails": {
            "default": list(spec.alerts.email) or None,
            "type": ["null", "array"],
            "items": {"type": "string", "pattern": EMAIL_PATTERN},
            "title": "Alert e-mails",
            "description": "Who is e-mailed for this DAG run, one address per line. Empty: the spec's alerts.email.",
        },
        "alert_channels": {
            "default": channels or None,
            "type": ["null", "array"],
            "items": channel_items,
            "uniqueItems": True,
            **channel_extra,
            "title": "Alert channels",
            "description": (
                f"Channels this DAG run alerts on, among those the spec configures: {', '.join(channels)}. Empty: none."
                if channels
                else "This spec configures no alert channel (alerts.email, alerts.slack_conn_id, alerts.webhook_conn_id)."
            ),
        },
    }


def explain(spec, conf: dict | None) -> list[str]:
    """Plain words for every value of `conf` that the form's schema refuses; [] when all are accepted."""

    problems = []
    for name, field in fields(spec).items():
        if not isinstance(conf, dict) or name not in conf:
            continue
        schema = {k: v for k, v in field.items() if k != "default"}
        for error in jsonschema.Draft202012Validator(schema).iter_errors(conf[name]):
            problems.append(_plain(spec, name, field, conf[name], error))
    return problems


def _plain(spec, name: str, field: dict, value: Any, error) -> str:
    title = field["title"]
    bad = error.instance
    kind = error.validator
    if kind == "type":
        types: list[str] = field["type"] if isinstance(field["type"], list) else [field["type"]]
        if "boolean" in types:
            return f"{title}: {value!r} is not true or false, e.g. false"
        want = " or ".join({"string": "text", "array": "a list"}.get(t, t) for t in types if t != "null")
        return f"{title}: {value!r} is not {want} (or leave it empty), e.g. {_example(spec, name)!r}"
    if name == "run" and kind == "pattern":
        return (
            f"{title}: {bad!r} is not a run name. A run name has 1 to 128 letters, digits, '.', '_' or '-', "
            f"starts with a letter or digit and has no '..' (it becomes a folder and an S3 prefix), "
            f"e.g. {_example(spec, name)!r}"
        )
    if name == "alert_emails" and kind == "pattern":
        return f"{title}: {bad!r} is not an e-mail address, e.g. 'ml-platform@example.com'"
    if name == "alert_channels" and kind in ("enum", "maxItems"):
        configured = configured_channels(spec)
        if not configured:
            return (
                f"{title}: spec {spec.name} configures no alert channel; leave this empty, or add "
                "alerts.email, alerts.slack_conn_id or alerts.webhook_conn_id to the spec"
            )
        return (
            f"{title}: {bad!r} is not a channel that spec {spec.name} configures; choose among "
            f"{', '.join(configured)}, e.g. {configured!r}"
        )
    if kind == "uniqueItems":
        return f"{title}: name each channel once, e.g. {_example(spec, name)!r}"
    return f"{title}: {error.message}"


def _example(spec, name: str) -> Any:
    return {
        "run": f"{spec.name}-2",
        "confirm_fresh_start": spec.name,
        "allow_drift": ["trainer.settings.rollout_n"],
        "alert_emails": ["ml-platform@example.com"],
        "alert_channels": configured_channels(spec) or [],
    }.get(name, "")
