"""The CPU GRPO trainer: a resumed run equals an uninterrupted one, bit for bit, and it learns."""

import os
import random
import signal
import subprocess
import time

import pytest

from relay.runs import layout
from relay.trainers.tiny_grpo.task import make_dataset
from support.helpers import PY, ROOT, assert_bitwise_equal, model_state, read_metrics, train, write_spec

STEPS = 12  # the test spec: 12 steps in chunks of 6


def comparable(rows):
    """Metric values that a deterministic resume must reproduce exactly."""
    return [(r["step"], r["reward_mean"], r["loss"], r["kl"], r["lr"]) for r in rows]


@pytest.mark.services
def test_chunked_run_equals_uninterrupted(baseline, tmp_path):
    spec, straight = baseline
    run_dir = tmp_path / "chunked"
    train(spec, run_dir, 6)
    r = train(spec, run_dir, STEPS)
    assert "resumes from step 6 (certified)" in r.stdout and "certified resume from step 6: probe log-probs" in r.stdout
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), model_state(straight / "global_step_12"))
    assert comparable(read_metrics(run_dir)) == comparable(read_metrics(straight))
    assert layout.read_tracker(run_dir) == STEPS


@pytest.mark.services
def test_sigkill_mid_chunk_resumes_exactly(baseline, tmp_path):
    spec, straight = baseline
    run_dir = tmp_path / "killed"
    train(spec, run_dir, 6)
    kill_at = random.Random(os.environ.get("RELAY_TEST_SEED")).randint(7, 11)
    proc = subprocess.Popen(
        [PY, "-m", "relay", "train", str(spec), "--to-step", str(STEPS), "--checkpoint-dir", str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and max((r["step"] for r in read_metrics(run_dir)), default=0) < kill_at:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert layout.read_tracker(run_dir) == 6, "the killed chunk must leave the previous checkpoint as latest"
    r = train(spec, run_dir, STEPS)
    assert "resumes from step 6 (certified)" in r.stdout
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), model_state(straight / "global_step_12"))
    rows = read_metrics(run_dir)
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1)), "no gap, no repeat"
    assert comparable(rows) == comparable(read_metrics(straight))


@pytest.mark.services
def test_resume_at_an_epoch_boundary(tmp_path):
    # 48 rows / 16 per step = 3 steps per epoch: the chunk ends exactly at the end of epoch 2.
    data = make_dataset(tmp_path / "small.parquet", 48, seed=5)
    spec = write_spec(tmp_path, **{"data.train_files": [str(data)], "trainer.settings.total_epochs": 4})
    for k in (6, 12):
        train(spec, tmp_path / "chunked", k)
    train(spec, tmp_path / "straight", STEPS)
    assert_bitwise_equal(
        model_state(tmp_path / "chunked" / "global_step_12"), model_state(tmp_path / "straight" / "global_step_12")
    )
    assert [r["epoch"] for r in read_metrics(tmp_path / "chunked")] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3


@pytest.mark.services
def test_reward_rises_within_60_steps(tmp_path):
    spec = write_spec(tmp_path, total_steps=60, chunk_steps=20)
    train(spec, tmp_path / "learn", 60)
    rewards = [r["reward_mean"] for r in read_metrics(tmp_path / "learn")]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-20:]) / 20
    assert last > first + 0.1, f"mean reward did not rise: first 10 steps {first:.3f}, last 20 {last:.3f}"


@pytest.mark.processes
def test_a_chunks_log_carries_its_step_lines_and_no_known_noise(tmp_path):
    """What a person reads in a chunk's log: Relay's step lines (the ETA of the chunk and of the run, named), and no
    warning of verl's platform detection on a host without an accelerator or of torchdata's deprecated torch call.
    A fresh `python -m relay train` process, as a job's driver is."""
    import subprocess
    import sys

    from relay.common.quiet import NOISE
    from support.helpers import ROOT, write_spec

    spec = write_spec(tmp_path, name="quiet")
    r = subprocess.run(
        [sys.executable, "-m", "relay", "train", str(spec), "--to-step", "2", "--offline"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "[relay] step 2/12 chunk 1 eta " in out and "(run eta " in out, out[-3000:]
    for noise in (*NOISE, "set_vital"):
        assert noise not in out, f"{noise!r} in the chunk's log:\n{out[-3000:]}"


@pytest.mark.processes
def test_airflows_task_processes_skip_the_pathspec_deprecation(tmp_path):
    """Every Airflow process of the local stack (and the compose file's) ignores pathspec's deprecation warning that
    Airflow's .airflowignore reader sets off in every task's log (Airflow's configuration, imported first, shows
    deprecation warnings unless warning options are set)."""
    import os
    import subprocess
    import sys

    from relay.devstack import stack

    code = (
        "import airflow.configuration; from pathspec.patterns.gitwildmatch import GitWildMatchPattern; "
        "GitWildMatchPattern('*.py')"
    )
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=plain)
    assert "GitWildMatchPattern" in shown.stdout + shown.stderr, "the warning this is about"
    env = stack.airflow_env(tmp_path / "home")
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**plain, **env})
    assert quiet.returncode == 0 and "GitWildMatchPattern" not in quiet.stdout + quiet.stderr, quiet.stdout
