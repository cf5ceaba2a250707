"""Frozen data and settings through real Airflow runs: with use_frozen a run whose source changed between chunks
finishes on the frozen bytes, bitwise; settings drift is refused at preflight and accepted only through allow_drift,
which is recorded. A source changed under a run that fails on it (the default) stops the next chunk before it
trains: tests/airflow/test_run_dag.py, in a run with warm chunks."""

import shutil
import time

import pyarrow.parquet as pq
import pytest

from relay.runs import layout
from relay.runs.record import read_record
from relay.s3.store import store_for_spec
from relay.spec.run_spec import load_spec
from support.helpers import (
    ROOT,
    assert_bitwise_equal,
    dags_test,
    model_state,
    read_metrics,
    start_dags_test,
    write_spec,
)

pytestmark = pytest.mark.services  # Airflow's own processes or DAG runs, on the session's Ray head and S3

DATA = ROOT / "include" / "data" / "arith_train.parquet"
STEPS = 12


def append_a_row_after_chunk_1(dag_test, run_dir, source):
    deadline = time.time() + 600
    while time.time() < deadline and (layout.read_tracker(run_dir) or 0) < 6:
        time.sleep(0.05)
    table = pq.read_table(source)
    rows = table.to_pylist()
    rows.append(dict(rows[0], extra_info={"split": "train", "index": 99999}))
    pq.write_table(table.from_pylist(rows, schema=table.schema), source)
    return dag_test.wait()


@pytest.fixture(scope="module")
def frozen_run(airflow_home, tmp_path_factory):
    """Run "dfrozen" (data.on_source_change: use_frozen), its source appended to after chunk 1."""
    source = shutil.copy(DATA, tmp_path_factory.mktemp("src") / "prompts.parquet")
    spec = write_spec(
        airflow_home["runs"],
        name="dfrozen",
        **{"data.train_files": [str(source)], "data.val_files": [], "data.on_source_change": "use_frozen"},
    )
    run_dir = load_spec(spec, check_environment=False).run_dir("dfrozen")
    rc, out = append_a_row_after_chunk_1(start_dags_test(airflow_home, "relay_dfrozen", {}), run_dir, source)
    return {"spec": spec, "source": source, "run_dir": run_dir, "rc": rc, "out": out}


@pytest.mark.fault
def test_use_frozen_finishes_on_the_frozen_bytes_and_resumes_exactly(frozen_run, fault_row, uninterrupted):
    assert frozen_run["rc"] == 0, frozen_run["out"][-4000:]
    assert "training continues on the frozen copy" in frozen_run["out"]
    warned = "[relay WARNING] dfrozen: source data changed; training continues on the frozen copy"
    assert frozen_run["out"].count(warned) == 1, "one warning for the change"
    rd = frozen_run["run_dir"]
    assert_bitwise_equal(model_state(rd / "global_step_12"), uninterrupted)  # the original data
    assert [r["step"] for r in read_metrics(rd)] == list(range(1, STEPS + 1))
    files = read_record(rd)["data"]["files"]
    assert [f["rows"] for f in files] == [1000], "trained on the frozen 1000 rows, not the 1001 of the source"
    fault_row(
        case="data-change",
        layer="full stack (Airflow, Ray, S3)",
        fault="a row is appended to the source parquet between chunk 1 and chunk 2 of a run whose spec says "
        "data.on_source_change: use_frozen",
        action="chunk 2's preflight found the change, alerted once (a warning) and went on: the trainer read "
        "the frozen copy, verified by sha256, so chunk 2 resumed from step 6 on the same 1000 rows",
        steps_lost=0,
        run_dir=rd,
        store=store_for_spec(load_spec(frozen_run["spec"], check_environment=False)),
    )


def test_settings_drift_is_refused_and_allow_drift_is_recorded(frozen_run, airflow_home):
    assert frozen_run["rc"] == 0
    same_target = load_spec(frozen_run["spec"], check_environment=False).s3.uri  # its asset stays the same
    write_spec(
        airflow_home["runs"],
        name="dfrozen",
        **{
            "data.train_files": [str(frozen_run["source"])],
            "data.val_files": [],
            "data.on_source_change": "use_frozen",
            "s3.uri": same_target,
            "trainer.settings.rollout_n": 4,
            # refused unattended, as with approvals off (`airflow dags
            # test` has no API server to answer a question; the asked
            # path: tests/e2e/test_real_airflow.py)
            "airflow.approvals": False,
        },
    )
    refused = dags_test(airflow_home, "relay_dfrozen", {})
    assert refused.returncode != 0
    assert "trainer.settings.rollout_n: 8 -> 4" in refused.stdout and "allow_drift" in refused.stdout
    assert "[relay ERROR] dfrozen: resume-critical settings changed" in refused.stdout
    allowed = dags_test(airflow_home, "relay_dfrozen", {"allow_drift": ["trainer.settings.rollout_n"]})
    assert allowed.returncode == 0, allowed.stdout[-3000:]
    assert "[relay OK] dfrozen: run recovered" in allowed.stdout, "the alerted run succeeded again"
    drift = read_record(frozen_run["run_dir"])["drift"][-1]
    assert drift["by"] and drift["at"] and drift["allowed"] == ["trainer.settings.rollout_n"]
    assert {"key": "trainer.settings.rollout_n", "was": 8, "now": 4} in drift["changes"]
