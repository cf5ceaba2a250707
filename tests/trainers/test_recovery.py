"""The CPU trainer recovers instead of crashing or restarting at step 0: fallback from a broken or corrupt
latest, refusal of unsafe pickles, restore from S3 onto an empty checkpoint dir."""

import os

import pytest

from relay.runs import layout
from relay.runs.record import read_record
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from support.helpers import assert_bitwise_equal, model_state, read_metrics, relay_cli, train

pytestmark = pytest.mark.services  # every test here reaches S3, Ray or Airflow

STEPS = 12


def test_tracker_naming_a_missing_step_falls_back_instead_of_restarting(baseline, tmp_path):
    spec, straight = baseline
    run_dir = tmp_path / "broken"
    train(spec, run_dir, 6)
    layout.write_tracker(run_dir, 99)  # verl would silently start again at step 0 here
    r = train(spec, run_dir, STEPS)
    assert (
        "refused the tracker: structure failed: the tracker names global_step_99, which does not exist" in r.stdout
        and "resumes from step 6" in r.stdout
    )
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


def test_a_new_folder_of_a_published_run_is_refused_and_restore_takes_the_run_on_purpose(baseline, tmp_path):
    spec, straight = baseline
    local = tmp_path / "host-a" / "run"
    train(spec, local, 6)
    uri = load_spec(spec).s3.uri
    pub = relay_cli("checkpoint", "publish", str(local), uri)
    assert pub.returncode == 0, pub.stderr
    # A new host, an empty folder, the same run name: never a silent continuation of the published run.
    fresh = tmp_path / "host-b" / "run"
    refused = relay_cli("train", str(spec), "--to-step", str(STEPS), "--checkpoint-dir", str(fresh))
    assert refused.returncode != 0, refused.stdout
    incarnation = read_record(local)["incarnation"]
    assert f"{uri}/run/ holds its incarnation {incarnation}" in refused.stderr and str(fresh) in refused.stderr
    assert f"relay checkpoint restore {uri} {fresh}" in refused.stderr, refused.stderr
    assert not (fresh / "global_step_6").exists()
    # On purpose: restore brings the run (its record, its incarnation) along, and training continues it.
    restored = relay_cli("checkpoint", "restore", uri, str(fresh))
    assert restored.returncode == 0, restored.stderr
    assert read_record(fresh)["incarnation"] == incarnation
    r = train(spec, fresh, STEPS)
    assert "resumes from step 6" in r.stdout
    train(spec, local, STEPS)
    assert_bitwise_equal(model_state(fresh / "global_step_12"), model_state(local / "global_step_12"))
    assert_bitwise_equal(model_state(fresh / "global_step_12"), model_state(straight / "global_step_12"))
    # --offline never looks at S3: a folder of its own, trained as a new run.
    offline = relay_cli(
        "train", str(spec), "--to-step", "3", "--checkpoint-dir", str(tmp_path / "host-c" / "run"), "--offline"
    )
    assert offline.returncode == 0, offline.stderr[-2000:]


def test_a_new_host_restores_its_own_run_from_s3_by_its_incarnation(baseline, tmp_path):
    """A chunk whose folder is empty on its host (the DAG carries the run's incarnation) restores the run's
    own checkpoints, and never another incarnation's."""
    import shutil

    from relay.trainers.contract import ChunkRequest
    from relay.trainers.session import ChunkSession

    spec_path, _straight = baseline
    local = tmp_path / "host-a" / "newhost"
    train(spec_path, local, 6)
    uri = load_spec(spec_path).s3.uri
    assert relay_cli("checkpoint", "publish", str(local), uri).returncode == 0
    incarnation = read_record(local)["incarnation"]
    fresh = tmp_path / "host-b" / "newhost"
    spec = load_spec(spec_path).model_copy(update={"checkpoint_dir": str(fresh.parent)})
    other = ChunkSession(ChunkRequest(run=Run.of(spec, "newhost", "20991231T000000Z-0000"), to_step=7))
    assert other.resume_step == 0 and not (fresh / "global_step_6").exists(), "another life's checkpoints: never"
    shutil.rmtree(fresh)
    own = ChunkSession(ChunkRequest(run=Run.of(spec, "newhost", incarnation), to_step=7))
    assert own.resume_step == 6 and own.resume.restored_from == f"{uri}/newhost/global_step_6/"
    assert read_record(fresh)["incarnation"] == incarnation, "the published record came along"
