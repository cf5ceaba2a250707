"""`relay doctor`: the pre-resume checklist, ✔ after an interrupted run and the right ✘ with its fix
for each thing that makes a resume unsafe."""

import os
import shutil
import signal
import subprocess
import time

import pyarrow.parquet as pq
import pytest

from relay.checkpoints.gate import admit_dir
from relay.insights import doctor
from relay.jobs.ray_jobs import RayJobs
from relay.runs import layout
from relay.runs.lease import Lease
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from support.helpers import PY, ROOT, relay_cli, write_spec

pytestmark = pytest.mark.services  # every test here reaches S3, Ray or Airflow


def failed(findings) -> dict:
    return {f.name: f for f in findings if not f.ok}


def respec(interrupted, **overrides):
    """The interrupted run's spec with some settings changed (same checkpoint dir and data)."""
    folder = interrupted["base"] / f"changed-{len(list(interrupted['base'].glob('changed-*')))}"
    return load_spec(write_spec(folder, **{**interrupted["overrides"], **overrides}), check_environment=False)


def test_after_an_interrupted_run_every_check_passes(interrupted, ray_address):
    r = relay_cli("doctor", str(interrupted["spec_path"]), "--run", "r", env={"RAY_ADDRESS": ray_address})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line[:1] in "✔✘"]
    assert len(lines) == 8 and all(line.startswith("✔") for line in lines), r.stdout
    assert "newest valid step 6" in r.stdout and "a resume is safe" in r.stdout
    assert "✔ save interval: a save costs C = " in r.stdout, "the Young–Daly advice, from the run's own costs"


def test_a_quarantined_latest(interrupted):
    spec = interrupted["spec"]
    shutil.copytree(spec.run_dir("r"), spec.run_dir("q"))
    model = layout.step_dir(spec.run_dir("q"), 6) / "actor" / "model_world_size_1_rank_0.pt"
    raw = bytearray(model.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    model.write_bytes(bytes(raw))
    assert not admit_dir(spec.run_dir("q"), 6).ok  # the gate quarantines it; the tracker falls back to 3
    bad = failed(doctor.diagnose(Run.of(spec, "q")))
    assert set(bad) == {"checkpoint"}
    assert "step 6 was quarantined (integrity" in bad["checkpoint"].detail
    assert "falls back to step 3" in bad["checkpoint"].detail and "restore" in bad["checkpoint"].fix


def test_a_changed_rollout_n(interrupted):
    bad = failed(doctor.diagnose(Run.of(respec(interrupted, **{"trainer.settings.rollout_n": 4}), "r")))
    assert set(bad) == {"algorithm", "settings"}
    assert "trainer.settings.rollout_n: 8 -> 4" in bad["algorithm"].detail and "allow_drift" in bad["algorithm"].fix


def test_a_changed_world_size(interrupted):
    bad = failed(doctor.diagnose(Run.of(respec(interrupted, **{"trainer.settings.world_size": 2}), "r")))
    assert set(bad) == {"parallelism", "settings"}
    assert "world size 2" in bad["parallelism"].detail and "model_world_size_1_rank_0.pt" in bad["parallelism"].detail
    assert "world_size: 1" in bad["parallelism"].fix


def test_a_modified_parquet(interrupted):
    src = interrupted["source"]
    original = src.read_bytes()
    rows = pq.read_table(src).to_pylist()
    rows.append(dict(rows[0], extra_info={"split": "train", "index": 4242}))
    pq.write_table(pq.read_table(src).from_pylist(rows, schema=pq.read_schema(src)), src)
    try:
        bad = failed(doctor.diagnose(Run.of(interrupted["spec"], "r")))
    finally:
        src.write_bytes(original)
    assert set(bad) == {"data"}
    assert "1 row(s) added (extra_info.index: 4242)" in bad["data"].detail and "use_frozen" in bad["data"].fix


def test_a_live_earlier_attempt(interrupted, ray_address):
    spec = interrupted["spec"]
    shutil.copytree(spec.run_dir("r"), spec.run_dir("live"))
    proc = subprocess.Popen(
        [PY, "-m", "relay", "train", str(interrupted["spec_path"]), "--to-step", "12", "--run", "live", "--offline"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while (Lease(spec.run_dir("live")).current() or {}).get("pid") != proc.pid and time.time() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGSTOP)  # an attempt that hangs, alive
        bad = failed(doctor.diagnose(Run.of(spec, "live"), jobs=RayJobs(ray_address)))
    finally:
        proc.kill()
        proc.wait()
    assert set(bad) == {"no live attempt"}
    assert f"trainer pid {proc.pid}" in bad["no live attempt"].detail and "kill" in bad["no live attempt"].fix


def test_verls_contract_is_checked_on_the_cluster_and_here(tmp_path, ray_address, monkeypatch):
    """A verl spec: the touch points of relay.trainers.verl_ppo.verl_contract, checked by a Ray job where the chunks
    run (the cluster's verl), or in this process with --offline; one gone makes a resume unsafe, named."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    from relay.ops.run_doctor import contract_report
    from support.verl_jobs import spec_variant

    spec = load_spec(spec_variant(tmp_path / "verl.yaml", tmp_path / "ckpt", {}), check_environment=False)
    run = Run.of(spec, "v")
    assert doctor.library_contract(run) is None, "the DAG's cheap checklist leaves it to each chunk's driver"
    on_cluster = doctor.library_contract(run, contract_report(spec, RayJobs(ray_address)))
    assert on_cluster.ok and not on_cluster.warning, on_cluster
    assert on_cluster.detail.startswith("the cluster's verl 0.9.1 (torch ") and "touch points hold" in on_cluster.detail
    offline = contract_report(spec, None)
    here = doctor.library_contract(run, offline)
    assert here.ok and here.detail.startswith("this host's verl 0.9.1")
    monkeypatch.delattr(
        next(c for c in ReplayBufferAsync.__mro__ if "_select_prompt_uids" in vars(c)), "_select_prompt_uids"
    )
    gone = doctor.library_contract(run, offline)
    assert not gone.ok and "ReplayBufferAsync._select_prompt_uids is gone (AttributeError" in gone.detail
    assert ") in verl 0.9.1; Relay relies on it since verl 0.9.1: FirstInFirstOut" in gone.detail
    assert "install verl 0.9.1" in gone.fix
