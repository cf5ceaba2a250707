"""The CPU GRPO trainer: a resumed run equals an uninterrupted one, bit for bit, and it learns."""

import os
import random
import signal
import subprocess
import time

import pytest

from conftest import PY, ROOT, assert_bitwise_equal, model_state, read_metrics, relay_cli, write_spec
from relay import layout
from relay.spec import load_spec
from relay.trainers.tiny_grpo.task import make_dataset

STEPS = 12  # the test spec: 12 steps in chunks of 6


def train(spec, run_dir, to_step):
    r = relay_cli("train", str(spec), "--to-step", str(to_step), "--checkpoint-dir", str(run_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def comparable(rows):
    """Metric values that a deterministic resume must reproduce exactly."""
    return [(r["step"], r["reward_mean"], r["loss"], r["kl"], r["lr"]) for r in rows]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted run of the test spec, 0 -> 12 in one process."""
    folder = tmp_path_factory.mktemp("baseline")
    spec = write_spec(folder)
    run_dir = folder / "ckpt" / "straight"
    train(spec, run_dir, STEPS)
    return spec, run_dir


def test_chunked_run_equals_uninterrupted(baseline, tmp_path):
    spec, straight = baseline
    run_dir = tmp_path / "chunked"
    train(spec, run_dir, 6)
    r = train(spec, run_dir, STEPS)
    assert "resumes from step 6" in r.stdout
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), model_state(straight / "global_step_12"))
    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(straight))
    assert layout.read_tracker(run_dir) == STEPS


def test_sigkill_mid_chunk_resumes_exactly(baseline, tmp_path):
    spec, straight = baseline
    run_dir = tmp_path / "killed"
    train(spec, run_dir, 6)
    kill_at = random.Random(os.environ.get("RELAY_TEST_SEED")).randint(7, 11)
    proc = subprocess.Popen([PY, "-m", "relay", "train", str(spec), "--to-step", str(STEPS), "--checkpoint-dir",
                             str(run_dir)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and max((r["step"] for r in read_metrics(run_dir)), default=0) < kill_at:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert layout.read_tracker(run_dir) == 6, "the killed chunk must leave the previous checkpoint as latest"
    r = train(spec, run_dir, STEPS)
    assert "resumes from step 6" in r.stdout
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), model_state(straight / "global_step_12"))
    rows = read_metrics(run_dir)
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1)), "no gap, no repeat"
    assert comparable(rows) == comparable(read_metrics(straight))


def test_resume_at_an_epoch_boundary(tmp_path):
    # 48 rows / 16 per step = 3 steps per epoch; chunks of 3 end exactly at epoch ends.
    data = make_dataset(tmp_path / "small.parquet", 48, seed=5)
    spec = write_spec(tmp_path, chunk_steps=3, **{"data.train_files": [str(data)], "trainer.settings.total_epochs": 4})
    for k in (3, 6, 9, 12):
        train(spec, tmp_path / "chunked", k)
    train(spec, tmp_path / "straight", STEPS)
    assert_bitwise_equal(model_state(tmp_path / "chunked" / "global_step_12"),
                         model_state(tmp_path / "straight" / "global_step_12"))
    assert [r["epoch"] for r in read_metrics(tmp_path / "chunked")] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3


def test_reward_rises_within_60_steps(tmp_path):
    spec = write_spec(tmp_path, total_steps=60, chunk_steps=20)
    train(spec, tmp_path / "learn", 60)
    rewards = [r["reward_mean"] for r in read_metrics(tmp_path / "learn")]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-20:]) / 20
    assert last > first + 0.1, f"mean reward did not rise: first 10 steps {first:.3f}, last 20 {last:.3f}"


def test_tracker_naming_a_missing_step_falls_back_instead_of_restarting(baseline, tmp_path):
    spec, straight = baseline
    run_dir = tmp_path / "broken"
    train(spec, run_dir, 6)
    layout.write_tracker(run_dir, 99)  # verl would silently start again at step 0 here
    r = train(spec, run_dir, STEPS)
    assert "quarantined checkpoint step 99" in r.stdout and "resumes from step 6" in r.stdout
    assert [x["step"] for x in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), model_state(straight / "global_step_12"))


def test_a_corrupt_latest_is_quarantined_and_the_run_falls_back(baseline, tmp_path):
    spec, straight = baseline
    run_dir = tmp_path / "corrupt"
    train(spec, run_dir, 3)
    train(spec, run_dir, 6)
    shard = run_dir / "global_step_6" / "actor" / "optim_world_size_1_rank_0.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    r = train(spec, run_dir, STEPS)
    assert "quarantined checkpoint step 6: integrity failed" in r.stdout and "resumes from step 3" in r.stdout
    assert not (run_dir / "global_step_6").exists() or layout.read_tracker(run_dir) == STEPS
    assert list((run_dir / ".relay" / "quarantine").glob("global_step_6.*.report.json"))
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), model_state(straight / "global_step_12"))


class _RunsCode:
    """A pickle payload: unpickling it with weights_only=False would create a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_runs_code_is_refused_and_never_runs(baseline, tmp_path):
    import torch

    spec, _ = baseline
    run_dir = tmp_path / "evil"
    train(spec, run_dir, 6)
    marker = tmp_path / "code-ran"
    torch.save({"state": _RunsCode(marker)}, run_dir / "global_step_6" / "data.pt", pickle_protocol=2)
    r = relay_cli("train", str(spec), "--to-step", str(STEPS), "--checkpoint-dir", str(run_dir))
    # Nothing valid is left: the run refuses to start again at step 0, and says why.
    assert r.returncode != 0 and "no valid checkpoint left" in r.stderr
    assert "step 6: loadability failed" in r.stderr and "unsafe: loading it needs posix.system" in r.stderr
    assert list((run_dir / ".relay" / "quarantine").glob("global_step_6.*.report.json"))
    assert not marker.exists(), "the pickle's code ran"


def test_an_empty_checkpoint_dir_restores_from_s3_and_resumes_the_same(baseline, tmp_path):
    spec, straight = baseline
    local = tmp_path / "host-a" / "run"
    train(spec, local, 6)
    uri = load_spec(spec).s3.uri
    pub = relay_cli("checkpoint", "publish", str(local), uri)
    assert pub.returncode == 0, pub.stderr
    # A new host: same run, empty local checkpoint dir.
    fresh = tmp_path / "host-b" / "run"
    r = train(spec, fresh, STEPS)
    assert "restored step 6 from s3://" in r.stdout and "resumes from step 6" in r.stdout
    train(spec, local, STEPS)
    assert_bitwise_equal(model_state(fresh / "global_step_12"), model_state(local / "global_step_12"))
    assert_bitwise_equal(model_state(fresh / "global_step_12"), model_state(straight / "global_step_12"))
