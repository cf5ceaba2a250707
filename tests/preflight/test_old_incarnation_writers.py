"""After a fresh start, nothing of a DAG run that worked for the old incarnation lands in the new one: its train
task's phase marks and failure records, its validate task's validation and quarantine, its publish task, its
fallback approval are refused (Lease.fence), and so is every such write while a fresh start is under way."""

import pytest

from relay.common.errors import LeaseLost
from relay.preflight.admission import admit
from relay.preflight.prepare import decide_fresh_start, prepare_run
from relay.runs import failure_cause, layout
from relay.runs.metrics import read_events
from relay.runs.phases import record_phase
from relay.s3.publication import publish_checkpoint
from relay.spec.run_spec import load_spec
from support.helpers import write_spec


def _old_and_new(tmp_path):
    spec = load_spec(write_spec(tmp_path, name="r", s3=None), check_environment=False)
    old = prepare_run(spec, "r").run(spec)  # the old DAG run's run, as its tasks pull it from XCom
    (old.dir / "global_step_2").mkdir()
    new = prepare_run(spec, "r", fresh_start=True, confirm="r", asked_by="DAG run d/new").run(spec)
    assert new.incarnation != old.incarnation
    return old, new


def _refused_writes(old) -> None:
    with pytest.raises(LeaseLost, match="refused"):
        record_phase(old.folder, "job_submitted", chunk=1, attempt="raysubmit_old")
    with pytest.raises(LeaseLost, match="refused"):
        admit(old, 2)
    with pytest.raises(LeaseLost, match="refused"):
        publish_checkpoint(old, 2, store=None)
    with pytest.raises(LeaseLost, match="refused"):
        old.folder.record("fallback_approved", chunk=1)
    cause = failure_cause.classify("FAILED", "boom", "", 1, step=3)
    assert failure_cause.record_failure(old.folder, cause, chunk=1, attempt="raysubmit_old") is None


@pytest.mark.fault
def test_an_old_dag_runs_tasks_write_nothing_into_the_new_incarnation(tmp_path, fault_row):
    old, new = _old_and_new(tmp_path)
    (new.dir / "global_step_2").mkdir()  # the new incarnation's own step 2: never the old run's to judge
    _refused_writes(old)
    assert read_events(new.dir) == [], "no mark, validation, failure or approval of the old DAG run"
    assert (new.dir / "global_step_2").is_dir() and not layout.relay_dir(new.dir, "quarantine").exists()
    record_phase(new.folder, "job_submitted", chunk=1, attempt="raysubmit_new")  # the new incarnation's own writes go on
    assert [e["attempt"] for e in read_events(new.dir)] == ["raysubmit_new"]
    fault_row(
        case="fresh-start-old-tasks",
        fault="a fresh start while an old DAG run's train, validate and publish tasks are still queued",
        action="each of their writes (phase mark, validation, quarantine, publication, failure record, approval) "
        "refused for the old incarnation; the new incarnation's step 2 neither validated nor quarantined by them",
        steps_lost=0,
        layer="airflow",
        run_dir=new.dir,
    )


def test_while_a_fresh_start_is_under_way_no_writer_of_the_run_writes(tmp_path):
    spec = load_spec(write_spec(tmp_path, name="r", s3=None), check_environment=False)
    run = prepare_run(spec, "r").run(spec)
    (run.dir / "global_step_2").mkdir()
    decide_fresh_start(run, "DAG run d/new")  # decided; S3 and the folder not moved yet
    with pytest.raises(LeaseLost, match="a fresh start that DAG run d/new decided"):
        record_phase(run.folder, "job_submitted", chunk=1, attempt="raysubmit_old")
    with pytest.raises(LeaseLost, match="a fresh start that DAG run d/new decided"):
        admit(run, 2)
    assert read_events(run.dir) == []
