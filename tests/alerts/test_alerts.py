"""Alerts in the core: what an alert says, one alert per failure event, recovery, and when a chunk is stalled."""

import json

import pytest

from relay.alerts import AlertLedger, StallWatch, kind_of, stall_limit_s
from relay.common.errors import CheckpointError, RelayError, StoreError
from relay.data.freeze import SourceDriftError
from relay.data.quality import DataQualityError
from relay.preflight.guard import DriftError
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from support.alerts import an_alert
from support.helpers import write_spec


def test_every_channel_says_the_same_facts():
    a = an_alert()
    facts = [
        "r1",
        "manual__1",
        "chunk_02.validate",
        "step 6",
        "s3://relay/runs/r1/global_step_6",
        "quarantine/global_step_12",
        "integrity",
        "the tracker names step 6",
        a.log_url,
    ]
    slack = json.dumps(a.slack())
    for rendered in (a.text(), a.html(), slack):
        missing = [f for f in facts if f not in rendered]
        assert not missing, (missing, rendered)
    assert a.subject() == "[relay ERROR] r1: checkpoint failed validation (chunk 2, step 12)"
    body = a.payload()
    assert body["relay_alert_version"] == 1 and body["severity"] == "error"
    assert {k: body[k] for k in ("run", "dag_run", "chunk", "step", "last_valid_step", "last_valid_uri")} == {
        "run": "r1",
        "dag_run": "manual__1",
        "chunk": 2,
        "step": 12,
        "last_valid_step": 6,
        "last_valid_uri": "s3://relay/runs/r1/global_step_6",
    }


def test_an_unknown_kind_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown alert kind"):
        an_alert(kind="oops")


def test_unpublished_last_checkpoint_is_said_not_hidden():
    assert "step 6 (not published to S3)" in an_alert(last_valid_uri=None).text()


@pytest.mark.parametrize(
    "error, kind",
    [
        (DataQualityError("bad rows", "fix them", []), "data_quality"),
        (SourceDriftError("changed", "restore"), "data_drift"),
        (DriftError("rollout_n 8 -> 4", "allow_drift"), "settings_drift"),
        (CheckpointError("torn", "resume"), "checkpoint_invalid"),
        (StoreError("S3 down", "start it"), "publish_failed"),
        (RelayError("other"), "chunk_failed"),
        (RuntimeError("job failed"), "chunk_failed"),
    ],
)
def test_errors_map_to_the_alert_a_person_needs(error, kind):
    assert kind_of(error, "chunk_failed") == kind


def test_one_alert_per_failure_event_and_one_recovery(tmp_path):
    ledger = AlertLedger(tmp_path / "run")
    stall = an_alert(kind="stall", task="chunk_02.train", try_number=1)
    assert ledger.claim("dr|chunk_02.train|stall", stall)
    retried = an_alert(kind="stall", task="chunk_02.train", try_number=2)
    assert not ledger.claim("dr|chunk_02.train|stall", retried), "a retry of the same event alerts again"
    assert ledger.alerted_in_try("manual__1", "chunk_02.train", 1)
    assert not ledger.alerted_in_try("manual__1", "chunk_02.train", 2)
    assert ledger.claim("use_frozen|abc", an_alert(kind="use_frozen"))
    assert [e["kind"] for e in ledger.open_failures()] == ["stall"], "warnings are not failures to recover from"
    ledger.delivered("dr|chunk_02.train|stall", {"email:relay_smtp": "sent"})
    ledger.close([e["key"] for e in ledger.open_failures()])
    assert ledger.open_failures() == []
    assert AlertLedger(tmp_path / "run").entries()[0]["delivered"] == {"email:relay_smtp": "sent"}


def test_a_torn_ledger_is_set_aside_not_fatal(tmp_path):
    ledger = AlertLedger(tmp_path / "run")
    ledger.path.parent.mkdir(parents=True)
    ledger.path.write_text('{"version": 1, "alerts": [')
    assert ledger.claim("k", an_alert())
    assert ledger.path.with_suffix(".json.unreadable").exists()


def test_stall_limit_comes_from_the_spec_or_the_runs_median_step_time(tmp_path):
    spec = load_spec(
        write_spec(tmp_path, "s", **{"alerts.stall_factor": 10, "alerts.stall_floor_minutes": 0.5}), check_environment=False
    )
    run = Run.of(spec, "r")
    assert stall_limit_s(run) == 30, "no steps yet: the floor"
    run.dir.mkdir(parents=True)
    (run.dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "seconds": s}) + "\n" for i, s in enumerate([2.0, 5.0, 6.0, 100.0], 1))
    )
    assert stall_limit_s(run) == 55, "10 x the median 5.5 s: one slow step does not move it"
    fixed = load_spec(write_spec(tmp_path, "f", **{"alerts.stall_minutes": 2}), check_environment=False)
    assert stall_limit_s(Run.of(fixed, "r")) == 120


def test_a_job_without_new_steps_is_stalled_after_its_limit():
    watch = StallWatch(limit_s=60, startup_s=300, started_at=0)
    assert watch.stalled(now=350) is None, "before the first step, startup time is allowed"
    watch.saw("[relay] run r: chunk 2 resumes from step 6\n[relay] step 7/12 chunk 2 reward=0.1\n", now=100)
    watch.saw("[relay] step 8/12 chunk 2 reward=0.2\n", now=110)
    assert watch.stalled(now=169) is None
    watch.saw("some other output\n", now=150)
    assert watch.stalled(now=171) == "no new step for 61s after step 8 (limit 60s)"
    never = StallWatch(limit_s=60, startup_s=300, started_at=0)
    assert never.stalled(now=361) == "no new step for 361s since the job started (limit 360s)"


def test_the_save_after_a_chunks_last_step_gets_the_startup_allowance():
    watch = StallWatch(limit_s=60, startup_s=300, started_at=0, end_step=12)
    watch.saw("[relay] step 12/12 chunk 2 reward=0.3\n", now=100)
    assert watch.stalled(now=400) is None, "a long save of the chunk's checkpoint is not a stall"
    assert watch.stalled(now=461) == "no new step for 361s after step 12, the chunk's last (saving) (limit 360s)"


def test_a_warning_sent_in_a_try_does_not_silence_its_failure_alert(tmp_path):
    """A train try that warned (a fallback, a decision) and then failed still alerts its failure: only a failure
    alert of its own in the same try makes the failure callback quiet."""
    from relay.alerts.ledger import AlertLedger

    ledger = AlertLedger(tmp_path)
    ledger.claim("fallback-key", an_alert(kind="fallback", task="chunk_02.train", try_number=1))
    assert not ledger.alerted_in_try("manual__1", "chunk_02.train", 1)
    ledger.claim("failure-key", an_alert(kind="chunk_failed", task="chunk_02.train", try_number=1))
    assert ledger.alerted_in_try("manual__1", "chunk_02.train", 1)


def test_each_kind_of_alert_reads_right_in_every_channel():
    """A failure says what failed; a decision asks its question, its Markdown read as words in the log and e-mail
    and as Slack's own bold; news (a warning, a recovery) says what happened."""
    failure = an_alert()
    assert ("What failed", failure.what) in failure.fields()
    decision = an_alert(
        kind="decision",
        what="Start run **demo** again from step 0?",
        details="- local: `/ckpt/demo` (steps 6) to `/ckpt/.archive/demo-<time>-<random>/`",
    )
    assert ("The question", "Start run demo again from step 0?") in decision.fields()
    text = decision.text()
    assert "What failed" not in text and "**" not in text and "`" not in text, text
    assert "<code>/ckpt/demo</code>" in decision.html() and "**" not in decision.html()
    slack = " ".join(b.get("text", {}).get("text", "") for b in decision.slack()["blocks"] if "text" in b)
    assert "`/ckpt/demo`" in slack and "```" not in slack
    for kind in ("fallback", "recovered", "finished"):
        assert an_alert(kind=kind).label == "What happened"
