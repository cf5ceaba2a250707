"""Saves off the critical path (checkpoints.async_save, relay.trainers.async_save): the CPU trainer copies what a
save writes into host buffers, trains on, and a thread writes, fsyncs and commits the copy.

- In one process, a save's files off the critical path are byte for byte a synchronous save's, and the host
  buffers are allocated once and reused.
- A run with async saves whose process is killed while a save is being written (SIGKILL, as an OOM kill) keeps
  the checkpoint before it as the latest, never the half-written one; its resume ends equal, bit for bit, to a
  run with synchronous saves.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from relay.common.faultpoint import KILL_ENV
from relay.runs import layout
from relay.runs.metrics import read_events
from support.helpers import ROOT, assert_bitwise_equal, model_state, read_metrics, relay_cli, write_spec

pytestmark = pytest.mark.processes  # trainer jobs in processes of their own: not in the fast lane

SAME_BYTES = """
import json, shutil, sys
from pathlib import Path
from relay.spec.run_spec import load_spec
from relay.checkpoints import certificate as C
from relay.trainers.tiny_grpo import trainer as T

DIGESTS = C.optimizer_digests

spec = load_spec(sys.argv[1], check_environment=False)
tr = T._TinyGRPO(spec, spec.data.train_files)
batches = tr.batches()
sizes = []
for step in (1, 2):
    tr.train_step(next(batches), step)
    sync, copied = Path(sys.argv[2], f"sync{step}"), Path(sys.argv[2], f"async{step}")
    sync.mkdir(); copied.mkdir()
    tr.save(sync, step)
    digested = []
    C.optimizer_digests = lambda *a, **k: (digested.append(1), DIGESTS(*a, **k))[1]
    write = tr.snapshot(copied, step)  # the copy, and the probe: what blocks training
    assert not digested, "the optimizer's moments were digested on the training thread"
    moments = [getattr(s["exp_avg"], "_local_tensor", s["exp_avg"]) for s in tr.optim.state.values()]
    held = [m.clone() for m in moments]
    for m in moments:  # training goes on and moves them before the save's thread runs
        m.add_(1.0)
    write()  # its writes, and the digests from the copy (the save's thread does them)
    for m, h in zip(moments, held):
        m.copy_(h)
    sizes.append(tr.host_buffers.nbytes)
    for f in sorted(p for p in sync.rglob("*") if p.is_file() and p.name != "relay_certificate.json"):
        assert f.read_bytes() == (copied / f.relative_to(sync)).read_bytes(), f
    certs = [json.loads((d / "relay_certificate.json").read_text()) for d in (sync, copied)]
    for c in certs:
        c.pop("probe_seconds")
    assert certs[0] == certs[1] and certs[0]["params"], "the digests taken from the copy are the model's"
    assert certs[0]["optimizer"] and digested, "and the optimizer's moments, as saved"
    print("same bytes", step, len(list(sync.rglob("*.pt"))), "files")
assert sizes[0] == sizes[1] > 0, sizes
print("host buffers reused", sizes)
"""


def test_a_save_off_the_critical_path_writes_a_synchronous_saves_bytes(tmp_path):
    spec = write_spec(tmp_path, s3=None)
    r = subprocess.run(
        [sys.executable, "-c", SAME_BYTES, str(spec), str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "plugins"), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "same bytes 2 4 files" in r.stdout and "host buffers reused" in r.stdout


def test_a_kill_during_an_async_save_keeps_the_checkpoint_before_it(tmp_path):
    steps = {"total_steps": 6, "chunk_steps": 6, "trainer.settings.save_freq": 2, "s3": None}
    sync_spec = write_spec(tmp_path / "sync", **steps)
    async_spec = write_spec(tmp_path / "async", **steps, **{"checkpoints.async_save": True})
    sync_dir, async_dir = tmp_path / "sync" / "run", tmp_path / "async" / "run"
    train = lambda spec, run_dir, env=None: relay_cli(  # noqa: E731
        "train", str(spec), "--to-step", "6", "--checkpoint-dir", str(run_dir), "--offline", env=env
    )
    assert train(sync_spec, sync_dir).returncode == 0

    killed = train(async_spec, async_dir, {KILL_ENV: "mid_save@4"})
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert "host buffers allocated before the first step" in killed.stdout
    assert layout.read_tracker(async_dir) == 2, "the save being written is never the latest"
    assert not layout.step_dir(async_dir, 4).exists()
    assert list(layout.relay_dir(async_dir, "staging").glob("global_step_4.*")), "the half-written save, in staging"
    assert [r["step"] for r in read_metrics(async_dir)][-1] >= 4, "training went on while step 4 was written"

    again = train(async_spec, async_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumes from step 2" in again.stdout
    assert not list(layout.relay_dir(async_dir, "staging").glob("global_step_4.*")), "the leftover is removed"
    for step in (2, 4, 6):
        assert_bitwise_equal(model_state(async_dir / f"global_step_{step}"), model_state(sync_dir / f"global_step_{step}"))
    drop = ("time", "seconds", "attempt")
    rows = lambda d: [{k: v for k, v in r.items() if k not in drop} for r in read_metrics(d)]  # noqa: E731
    assert rows(async_dir) == rows(sync_dir)
    saves = [e for e in read_events(async_dir) if e["event"] == "checkpoint"]
    assert [e["step"] for e in saves] == [2, 4, 6]
    assert all(e["seconds"] <= e["written_seconds"] and e["blocking_until"] for e in saves), saves
