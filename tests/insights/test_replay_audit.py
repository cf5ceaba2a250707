"""The replay audit (relay.insights.audit, `relay audit`): the steps a resume trains again, against their first try.

A chunk killed after step 9 (its last checkpoint at 6) resumes from 6 and trains 7..9 again: the CPU trainer
trains them to the same values, bit for bit, so the audit is consistent. A row of the first try changed by hand
is reported with its step and metric, and `relay audit` exits 1; the spec's audit.tolerance allows a stated
difference per metric.
"""

from __future__ import annotations

import json
import math

import pytest

from relay.common.errors import SpecError
from relay.common.faultpoint import KILL_ENV
from relay.insights import report as run_report
from relay.insights.audit import _ranges, _same, audit
from relay.runs import layout
from relay.runs.metrics import SUPERSEDED, read_jsonl
from relay.spec.run_spec import load_spec
from support.helpers import relay_cli, write_spec


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """A 12-step run (checkpoints every 3 steps) killed after step 8's row, resumed from 6 and finished."""
    base = tmp_path_factory.mktemp("audit")
    spec = write_spec(
        base,
        **{
            "trainer.settings.save_freq": 3,
            "trainer.settings.train_batch_size": 4,
            "trainer.settings.rollout_n": 2,
            "trainer.settings.ppo_mini_batch_size": 2,
        },
    )
    run_dir = base / "run"
    train = ("train", str(spec), "--checkpoint-dir", str(run_dir), "--offline", "--to-step")
    killed = relay_cli(*train, "12", env={KILL_ENV: "after_step@8"})
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert layout.read_tracker(run_dir) == 6
    again = relay_cli(*train, "12")
    assert again.returncode == 0 and "resumes from step 6" in again.stdout, again.stderr[-2000:]
    return {"spec": spec, "run_dir": run_dir}


def test_the_steps_a_resume_trains_again_are_the_same_to_the_bit(resumed):
    report = audit(resumed["run_dir"])
    assert report.consistent and report.steps == [7, 8] and report.compared == 2, report.summary()
    assert report.summary().startswith("replay audit: consistent: 2 step(s) trained twice (7-8)")
    r = relay_cli("audit", str(resumed["run_dir"]))
    assert r.returncode == 0 and "consistent" in r.stdout, r.stdout + r.stderr
    assert "replay audit: consistent" in run_report.build(resumed["run_dir"]).summary()


def test_a_tampered_first_try_is_reported_with_its_step_and_metric(resumed, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(resumed["run_dir"], run_dir)
    rows = read_jsonl(run_dir / SUPERSEDED)
    rows[-1]["loss"] += 1e-7  # the first try of step 8, changed by a hair
    (run_dir / SUPERSEDED).write_text("".join(json.dumps(r) + "\n" for r in rows))

    r = relay_cli("audit", str(run_dir), "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    out = json.loads(r.stdout)  # the JSON alone on stdout
    assert not out["consistent"] and [(d["step"], d["metric"]) for d in out["divergences"]] == [(8, "loss")]
    text = relay_cli("audit", str(run_dir)).stdout
    assert "DIVERGED at step(s) 8" in text and "step 8: loss" in text and "(exact)" in text
    report = run_report.build(run_dir)
    assert "DIVERGED" in report.summary() and any(m.kind == "divergence" and m.step == 8 for m in report.markers)

    # A tolerance stated in the spec allows it; a negative one is refused when the spec loads.
    tolerant = write_spec(tmp_path / "tolerant", **{"audit.tolerance": {"loss": 1e-6}})
    assert relay_cli("audit", str(run_dir), "--spec", str(tolerant)).returncode == 0
    assert audit(run_dir, {"*": 1e-6}).consistent and not audit(run_dir, {"reward_mean": 1.0}).consistent
    with pytest.raises(SpecError, match=r"audit\.tolerance"):
        load_spec(write_spec(tmp_path / "bad", **{"audit.tolerance": {"loss": -1}}), check_environment=False)


def test_a_divergence_alerts_once_with_its_steps_and_metrics(resumed, tmp_path):
    """The train task's alert (relay.airflow.notifiers.notify_divergence): one per set of diverged steps, however
    many chunks end after it; none for a consistent run."""
    import shutil
    from types import SimpleNamespace

    from relay.airflow.notifiers import notify_divergence
    from relay.alerts import AlertLedger
    from relay.runs.run import Run

    spec = load_spec(resumed["spec"], check_environment=False).model_copy(
        update={"checkpoint_dir": str(tmp_path), "s3": None}
    )
    run = Run.of(spec, "run")
    shutil.copytree(resumed["run_dir"], run.dir)
    context = {
        "ti": SimpleNamespace(dag_id="relay_t", task_id="chunk_02.train", try_number=1, log_url=""),
        "dag_run": SimpleNamespace(run_id="manual__1"),
        "params": {},
    }
    notify_divergence(context, run, audit(run.dir))
    assert AlertLedger(run.dir).entries() == [], "a consistent replay is not alerted"

    rows = read_jsonl(run.dir / SUPERSEDED)
    rows[0]["reward_mean"] += 0.5  # step 7's first try
    (run.dir / SUPERSEDED).write_text("".join(json.dumps(r) + "\n" for r in rows))
    for task in ("chunk_02.train", "chunk_03.train"):
        context["ti"].task_id = task
        notify_divergence(context, run, audit(run.dir))
    [alert] = AlertLedger(run.dir).entries()
    assert (alert["kind"], alert["severity"], alert["step"], alert["open"]) == ("replay_divergence", "warning", 7, False)
    assert alert["what"].startswith("replay audit: DIVERGED at step(s) 7 of the 2 trained twice")


def test_what_counts_as_the_same():
    assert _same(1.0, 1.0, 0) and not _same(1.0, 1.0 + 1e-12, 0) and _same(1.0, 1.1, 0.2)
    assert _same(math.nan, math.nan, 0) and not _same(math.nan, 1.0, 1.0)
    assert _same([3, 1, 2], [3, 1, 2], 0) and not _same([3, 1, 2], [1, 2, 3], 0.5), "data order is compared exactly"
    assert not _same(None, 1.0, 0), "a metric only one try logged differs"
    assert _ranges([9, 3, 4, 5, 7, 8, 12]) == "3-5, 7-9, 12"
