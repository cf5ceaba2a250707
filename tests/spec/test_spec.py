"""A run spec is refused when it is loaded, with an error naming the offending key."""

from pathlib import Path

import pytest
import yaml

from relay.common.errors import SpecError
from relay.spec.run_spec import load_spec
from support.helpers import DELETE, DEMO_SPEC, spec_dict, write_spec


def refused(tmp_path: Path, **overrides) -> SpecError:
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(tmp_path, **overrides))
    return e.value


def test_demo_spec_is_valid_and_marks_resume_critical_keys():
    spec = load_spec(DEMO_SPEC)
    crit = spec.resume_critical()
    for key in (
        "total_steps",
        "seed",
        "threads",
        "checkpoint_dir",
        "data.train_files",
        "trainer.kind",
        "trainer.settings.rollout_n",
        "trainer.settings.adv_estimator",
        "trainer.settings.kl_loss_coef",
        "trainer.settings.train_batch_size",
        "trainer.settings.optim.lr",
        "trainer.settings.world_size",
        "trainer.settings.fsdp_version",
    ):
        assert key in crit, key
    # What may change between chunks is not resume-critical.
    for key in ("chunk_steps", "trainer.settings.save_freq", "ray.conn_id", "alerts.email", "airflow.retries"):
        assert key not in crit, key
    assert Path(spec.checkpoint_dir).is_absolute()


def test_fingerprint_changes_only_with_resume_critical_settings(tmp_path):
    base = load_spec(write_spec(tmp_path / "a")).settings_fingerprint()
    same = load_spec(write_spec(tmp_path / "a", chunk_steps=3)).settings_fingerprint()
    other = load_spec(write_spec(tmp_path / "a", **{"trainer.settings.rollout_n": 4})).settings_fingerprint()
    assert base == same != other


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    e = refused(tmp_path, chunk_step=5)
    assert e.key == "chunk_step" and "unknown key" in str(e) and "did you mean 'chunk_steps'" in str(e)


def test_unknown_trainer_setting_is_named(tmp_path):
    e = refused(tmp_path, **{"trainer.settings.rollout": 4})
    assert e.key == "trainer.settings.rollout" and "rollout_n" in str(e)


@pytest.mark.parametrize("value", [0, -3])
def test_chunk_steps_must_be_positive(tmp_path, value):
    e = refused(tmp_path, chunk_steps=value)
    assert e.key == "chunk_steps" and "greater than 0" in str(e)


def test_total_the_data_cannot_supply(tmp_path):
    # 1000 rows / 16 per step = 62 steps per epoch, one epoch.
    e = refused(tmp_path, total_steps=100)
    assert e.key == "total_steps" and "cannot supply 100 steps" in str(e) and "62 steps" in str(e)


def test_unwritable_checkpoint_dir(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    e = refused(tmp_path, checkpoint_dir=str(a_file / "ckpt"))
    assert e.key == "checkpoint_dir" and "not writable" in str(e)
    e = refused(tmp_path, checkpoint_dir="/proc/relay-ckpt")
    assert e.key == "checkpoint_dir"


def test_missing_required_key_and_bad_values(tmp_path):
    assert refused(tmp_path, seed=DELETE).key == "seed"
    assert refused(tmp_path, name="Bad Name").key == "name"
    assert refused(tmp_path, **{"trainer.kind": "nope"}).key == "trainer.kind"
    assert refused(tmp_path, **{"s3.uri": "http://x"}).key == "s3.uri"
    assert refused(tmp_path, **{"data.train_files": ["missing.parquet"]}).key == "data.train_files[0]"
    assert refused(tmp_path, **{"trainer.settings.ppo_mini_batch_size": 5}).key == "trainer.settings"


def test_not_yaml_and_not_a_mapping(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(p)
    p.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(SpecError, match="must be a mapping"):
        load_spec(p)


def test_env_var_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAY_TEST_ROOT", str(tmp_path / "from-env"))
    spec = load_spec(write_spec(tmp_path, checkpoint_dir="${RELAY_TEST_ROOT}/ckpt"))
    assert spec.checkpoint_dir == str(tmp_path / "from-env" / "ckpt")
    e = refused(tmp_path, checkpoint_dir="${RELAY_UNSET_VARIABLE}/x")
    assert e.key == "checkpoint_dir" and "RELAY_UNSET_VARIABLE" in str(e)


@pytest.mark.parametrize("name", ["../escape", "a/b", "", ".hidden", "x" * 200])
def test_run_names_cannot_escape_the_checkpoint_root(name):
    spec = load_spec(DEMO_SPEC, check_environment=False)
    with pytest.raises(SpecError):
        spec.run_dir(name)


def test_spec_round_trips_through_json():
    from relay.spec.run_spec import spec_from_json

    spec = load_spec(DEMO_SPEC, check_environment=False)
    again = spec_from_json(spec.to_json())
    assert again == spec and again.settings_fingerprint() == spec.settings_fingerprint()


def test_spec_dict_helper_matches_demo():
    assert spec_dict()["trainer"]["kind"] == "tiny_grpo"
