"""Frozen data and frozen settings: quality checks, fingerprints, source drift, settings drift."""

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relay.data import quality
from relay.data.fingerprint import DataError, fingerprint
from relay.data.freeze import check_sources, frozen_files, verify_frozen
from relay.preflight import guard
from relay.preflight.checks import before_chunk, prepare_data
from relay.preflight.prepare import prepare_run
from relay.runs.record import read_record
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from support.helpers import DEMO_SPEC, ROOT, write_spec

DATA = ROOT / "include" / "data" / "arith_train.parquet"


def rows():
    return pq.read_table(DATA).to_pylist()


def write(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def test_fingerprints_are_stable_and_change_with_any_byte(tmp_path):
    copy = shutil.copy(DATA, tmp_path / "elsewhere.parquet")
    a, b = fingerprint(DATA), fingerprint(copy)
    assert a == b and a.rows == 1000 and "reward_model" in a.schema
    raw = bytearray(open(copy, "rb").read())
    raw[100] ^= 1
    open(copy, "wb").write(bytes(raw))
    assert fingerprint(copy).sha256 != a.sha256


def test_valid_data_passes_the_suite_and_spec_expectations():
    spec = load_spec(DEMO_SPEC)
    extra = quality.load_expectations(spec.data.expectations[0])
    report = quality.check(DATA, min_rows=16, extra=extra)
    assert report.ok, report.summary()
    assert len(report.suite) == 8


BAD = {
    "null ground_truth": (
        lambda r: r[3]["reward_model"].update(ground_truth=None),
        "expect_column_values_to_not_be_null on reward_model.ground_truth",
        "extra_info.index=3",
    ),
    "duplicated index": (
        lambda r: r[5]["extra_info"].update(index=4),
        "expect_column_values_to_be_unique on extra_info.index",
        "extra_info.index=4",
    ),
    "empty prompt": (lambda r: r[7].update(prompt=[]), "on prompt.valid", "extra_info.index=7"),
    "null data_source": (lambda r: r[9].update(data_source=None), "not_be_null on data_source", "extra_info.index=9"),
}


@pytest.mark.parametrize("defect", list(BAD))
def test_bad_rows_are_named_with_examples(tmp_path, defect):
    change, expectation, example = BAD[defect]
    records = rows()
    change(records)
    report = quality.check(write(tmp_path / "bad.parquet", records), min_rows=16)
    assert not report.ok and expectation in report.summary() and example in report.summary(), report.summary()


def test_a_renamed_column_and_too_few_rows(tmp_path):
    table = pq.read_table(DATA).rename_columns(["data_source", "prompt", "ability", "reward", "extra_info"])
    pq.write_table(table, tmp_path / "renamed.parquet")
    report = quality.check(tmp_path / "renamed.parquet", min_rows=2000)
    text = report.summary()
    assert "reward_model.ground_truth (column missing; renamed to 'reward.ground_truth'?)" in text
    assert "expect_table_row_count_to_be_between: observed 1000" in text


def test_a_pass_is_remembered_for_the_same_bytes_and_suite_only(tmp_path, monkeypatch):
    """The same bytes against the same suite pass again without great-expectations; a changed byte or
    expectation runs it, and a failure is never remembered."""
    monkeypatch.setenv("RELAY_DATA_CHECK_CACHE", str(tmp_path / "cache"))
    runs = []
    real = quality._run_suite
    monkeypatch.setattr(quality, "_run_suite", lambda df, ex: runs.append(len(ex)) or real(df, ex))
    src = shutil.copy(DATA, tmp_path / "a.parquet")
    assert quality.check(src, min_rows=16).ok and quality.check(src, min_rows=16).ok
    assert len(runs) == 1, "the second check of the same bytes reused the first one's pass"
    assert "PASS (remembered: these bytes passed this suite at 20" in quality.check(src, min_rows=16).summary()
    assert quality.check(src, min_rows=17).ok and len(runs) == 2, "another suite (min_rows) runs again"
    table = pq.read_table(src)
    pq.write_table(table.slice(1), src)  # one row fewer: other bytes
    assert quality.check(src, min_rows=16).ok and len(runs) == 3
    failing = quality.check(src, min_rows=5000)
    assert not failing.ok and not quality.check(src, min_rows=5000).ok and len(runs) == 5, "failures run each time"
    monkeypatch.setenv("RELAY_DATA_CHECK_CACHE", "off")
    assert quality.check(src, min_rows=16).ok and len(runs) == 6


def test_an_exception_inside_great_expectations_is_not_bad_data(tmp_path):
    # The mean of a string column makes great-expectations raise inside its metric computation.
    extra = [("expect_column_mean_to_be_between", {"column": "data_source", "min_value": 0}, "")]
    with pytest.raises(quality.QualityCheckError, match="not a data problem"):
        quality.check(DATA, min_rows=16, extra=extra)


@pytest.fixture
def frozen_run(tmp_path):
    """A run whose source file (a copy of the demo data) has been frozen at its first chunk."""
    src = shutil.copy(DATA, tmp_path / "source.parquet")
    spec = load_spec(write_spec(tmp_path, **{"data.train_files": [str(src)], "data.val_files": []}))
    prepare_run(spec, "r")
    state = prepare_data(Run.of(spec, "r"))
    assert state.froze_now
    return spec, src


MUTATIONS = {
    "row appended": (
        lambda r: [*r, dict(r[0], extra_info={"split": "train", "index": 5000})],
        "1 row(s) added (extra_info.index: 5000)",
    ),
    "row deleted": (lambda r: r[:10] + r[11:], "1 row(s) removed (extra_info.index: 10)"),
    "rows reordered": (lambda r: r[1:] + r[:1], "rows reordered"),
    "null ground_truth": (
        lambda r: [dict(x, reward_model={"style": "rule", "ground_truth": None}) if i == 2 else x for i, x in enumerate(r)],
        "1 row(s) changed (extra_info.index: 2)",
    ),
    "duplicated index": (
        lambda r: [dict(x, extra_info={"split": "train", "index": 1}) if i == 2 else x for i, x in enumerate(r)],
        "1000 -> 1000",
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_source_changed_between_chunks_is_caught_before_the_next(frozen_run, mutation):
    spec, src = frozen_run
    change, words = MUTATIONS[mutation]
    write(src, change(rows()))
    with pytest.raises(DataError) as e:
        before_chunk(Run.of(spec, "r"))
    assert "the training data changed under run r" in str(e.value) and words in str(e.value), str(e.value)
    assert "use_frozen" in str(e.value)


def test_a_renamed_column_in_the_source_is_caught(frozen_run):
    spec, src = frozen_run
    table = pq.read_table(src).rename_columns(["data_source", "prompt", "ability", "reward", "extra_info"])
    pq.write_table(table, src)
    with pytest.raises(DataError, match=r"schema: - reward_model"):
        before_chunk(Run.of(spec, "r"))


def test_use_frozen_continues_on_the_frozen_bytes(tmp_path, frozen_run):
    spec, src = frozen_run
    spec = spec.model_copy(update={"data": spec.data.model_copy(update={"on_source_change": "use_frozen"})})
    write(src, rows()[:-1])
    changes = check_sources(Run.of(spec, "r"))
    assert len(changes) == 1 and "1 row(s) removed" in changes[0].summary()
    files = frozen_files(spec.run_dir("r"))
    paths = verify_frozen(spec.run_dir("r"), files)
    assert fingerprint(paths["train"][0]).sha256 == fingerprint(DATA).sha256


def test_an_altered_frozen_copy_is_refused(frozen_run):
    spec, _ = frozen_run
    files = frozen_files(spec.run_dir("r"))
    with open(files[0].path(spec.run_dir("r")), "ab") as f:
        f.write(b"x")
    with pytest.raises(DataError, match="does not match its sha256"):
        verify_frozen(spec.run_dir("r"), files)


DRIFTS = {
    "rollout.n": ("trainer.settings.rollout_n", 4),
    "adv_estimator": ("trainer.settings.adv_estimator", "rloo"),
    "world size": ("trainer.settings.world_size", 2),
    "LR schedule": ("trainer.settings.optim.schedule", "constant"),
}


@pytest.mark.parametrize("drift", list(DRIFTS))
def test_settings_drift_is_refused_with_a_diff_and_accepted_only_when_allowed(tmp_path, frozen_run, drift):
    _spec, src = frozen_run
    key, value = DRIFTS[drift]
    changed = load_spec(write_spec(tmp_path, **{"data.train_files": [str(src)], "data.val_files": [], key: value}))
    with pytest.raises(guard.DriftError) as e:
        before_chunk(Run.of(changed, "r"))
    assert key in str(e.value) and f"-> {value!r}" in str(e.value) and "allow_drift" in str(e.value)
    allowed = guard.check(Run.of(changed, "r"), allow_drift=[key], by="alice", dag_run="manual__1")
    assert [c.key for c in allowed if c.key == key] == [key]
    drift_log = read_record(changed.run_dir("r"))["drift"]
    assert drift_log[-1]["by"] == "alice" and drift_log[-1]["dag_run"] == "manual__1"
    assert any(c["key"] == key and c["now"] == value for c in drift_log[-1]["changes"])
    before_chunk(Run.of(changed, "r"))  # the allowed settings are now the run's own


def test_the_recorded_snapshot_holds_model_parallelism_algorithm_schedule_data_and_seed(frozen_run):
    spec, _ = frozen_run
    values = read_record(spec.run_dir("r"))["settings"]["values"]
    for key in (
        "trainer.settings.model.hidden_size",
        "trainer.settings.world_size",
        "trainer.settings.fsdp_version",
        "trainer.settings.adv_estimator",
        "trainer.settings.rollout_n",
        "trainer.settings.kl_loss_coef",
        "trainer.settings.train_batch_size",
        "trainer.settings.optim.schedule",
        "total_steps",
        "seed",
        "data.fingerprint",
        "resolved.steps_per_epoch",
        "resolved.lr_horizon",
    ):
        assert key in values, key


def test_a_setting_added_by_a_relay_upgrade_at_its_default_is_not_drift(frozen_run):
    """A run recorded before a setting existed (trainer.settings.device, say) resumes after the upgrade;
    the same key recorded with another value, or an unknown key, is still drift."""
    from relay.runs.record import update_record

    spec, _ = frozen_run
    run = Run.of(spec, "r")
    values = read_record(run.dir)["settings"]["values"]
    key = "trainer.settings.world_size"
    older = {k: v for k, v in values.items() if k != key}
    update_record(run.dir, settings={**read_record(run.dir)["settings"], "values": older})
    assert guard.check(run) == []
    update_record(run.dir, settings={**read_record(run.dir)["settings"], "values": {**values, key: 2}})
    with pytest.raises(guard.DriftError, match=key):
        guard.check(run)
