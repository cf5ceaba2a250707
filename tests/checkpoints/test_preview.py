"""`relay checkpoint inspect`: what a resume would load, read from the files without a trainer."""

import json

import pytest

from relay.checkpoints.preview import inspect_dir
from relay.runs import layout
from support.helpers import read_metrics, relay_cli

pytestmark = pytest.mark.services  # every test here reaches S3, Ray or Airflow


def test_inspect_shows_the_step_epoch_and_dataloader_offset_a_resume_loads(interrupted):
    spec, run_dir = interrupted["spec"], interrupted["run_dir"]
    p = inspect_dir(run_dir)
    s = spec.settings
    assert (p.step, p.epoch, p.batches_in_epoch) == (6, 0, 6)
    assert (p.samples_in_epoch, p.samples_per_epoch) == (6 * s.train_batch_size, 1000)
    assert p.optimizer_steps == 6 * (s.train_batch_size // s.ppo_mini_batch_size), "one per mini-batch"
    assert p.scheduler_steps == 6
    assert p.lr_now == next(r["lr"] for r in read_metrics(run_dir) if r["step"] == 6) and p.lr_next is not None
    assert {"cpu", "numpy", "python"} <= set(p.rng)
    assert (p.world_size, p.fsdp_version, p.dtypes) == (1, 2, ["float32"]) and p.parameters > 10_000
    assert "actor/model_world_size_1_rank_0.pt" in p.files and p.checksums_ok is None, "not admitted yet"
    assert "epoch 0, dataloader at 96 of 1000 samples (6 batches)" in p.one_line()


def test_inspect_checks_the_manifest_locally_and_in_s3(interrupted, tmp_path):
    run_dir = interrupted["run_dir"]
    uri = f"{interrupted['spec'].s3.uri}/inspect"
    pub = relay_cli("checkpoint", "publish", str(run_dir), uri, "--run", "r")
    assert pub.returncode == 0, pub.stderr
    local = relay_cli("checkpoint", "inspect", str(run_dir), "--json")
    assert local.returncode == 0, local.stderr
    here = json.loads(local.stdout)
    assert here["checksums_ok"] is True and "match the manifest" in here["checksums"]
    remote = relay_cli("checkpoint", "inspect", f"{uri}/r/global_step_6", "--json")
    assert remote.returncode == 0, remote.stderr
    there = json.loads(remote.stdout)
    assert there["checksums_ok"] is True and there["files"] == here["files"]
    for key in ("step", "batches_in_epoch", "samples_in_epoch", "optimizer_steps", "lr_next", "rng", "parameters"):
        assert there[key] == here[key], key

    model = layout.step_dir(run_dir, 6) / "actor" / "model_world_size_1_rank_0.pt"
    raw = bytearray(model.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    model.write_bytes(bytes(raw))
    try:
        broken = relay_cli("checkpoint", "inspect", str(run_dir))
        assert broken.returncode == 1 and "checksums" in broken.stdout
        assert "model_world_size_1_rank_0.pt" in broken.stdout
    finally:
        raw[len(raw) // 2] ^= 0xFF
        model.write_bytes(bytes(raw))
