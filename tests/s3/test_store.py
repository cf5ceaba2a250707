"""S3 publication on the session's real S3 server (SeaweedFS): atomic, idempotent, verified, retained."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from relay.checkpoints import retention
from relay.checkpoints.gate import admit_dir
from relay.runs import layout
from relay.runs.folder import RunFolder
from relay.s3.restore import restore
from relay.s3.store import CheckpointStore, s3_client
from relay.spec.run_spec import CheckpointPolicy
from support import verl_checkpoint
from support.helpers import PY, ROOT, relay_cli


@pytest.fixture
def store():
    return CheckpointStore(s3_client(), f"s3://relay/test-store-{uuid.uuid4().hex[:10]}", part_size=5 << 20)


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    """A run with two validated checkpoints of ~110 MB each (multipart objects at 5 MB parts)."""
    run = tmp_path_factory.mktemp("big") / "run"
    verl_checkpoint.make_many([{"run_dir": run, "step": step, "hidden": 512, "layers": 2, "vocab": 4096} for step in (1, 2)])
    for step in (1, 2):
        assert admit_dir(run, step).ok
    return run


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A run with one small checkpoint (global_step_1, not validated yet), for tests that copy it."""
    return verl_checkpoint.make(tmp_path_factory.mktemp("small") / "run").parent


def objects(store, run, step):
    r = store.client.list_objects_v2(Bucket=store.bucket, Prefix=store.step_key(run, step) + "/")
    return [o["Key"] for o in r.get("Contents", [])]


@pytest.mark.services
def test_publish_is_verified_idempotent_and_moves_latest_last(big_run, store):
    first = store.publish(RunFolder("run", big_run), 1)
    assert first.latest_moved and not first.skipped and store.latest("run")["step"] == 1
    head = store.head(store.step_key("run", 1, "actor/optim_world_size_1_rank_0.pt"))
    assert head["ChecksumType"] == "FULL_OBJECT" and head["ContentLength"] > 5 << 20  # a multipart object
    again = store.publish(RunFolder("run", big_run), 1)
    assert not again.uploaded and len(again.skipped) == len(first.uploaded), "nothing is uploaded twice"
    listing = relay_cli("checkpoint", "ls", store.uri, "--run", "run")
    assert "step       1  published" in listing.stdout and "latest" in listing.stdout


@pytest.mark.services
def test_a_killed_publish_leaves_latest_and_completes_on_rerun(big_run, store):
    store.publish(RunFolder("run", big_run), 1)
    code = (
        "import sys; sys.path.insert(0, 'plugins'); from pathlib import Path; "
        "from relay.s3.store import CheckpointStore, s3_client; from relay.runs.folder import RunFolder; "
        f"CheckpointStore(s3_client(), {store.uri!r}, part_size=5 << 20, concurrency=1)"
        f".publish(RunFolder('run', Path({str(big_run)!r})), 2)"
    )
    proc = subprocess.Popen([PY, "-c", code], cwd=ROOT)
    deadline = time.time() + 60
    while time.time() < deadline and len(objects(store, "run", 2)) < 2:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = objects(store, "run", 2)
    assert partial and not any(k.endswith("relay_manifest.json") for k in partial), "killed halfway"
    assert store.latest("run")["step"] == 1, "latest never points at an incomplete checkpoint"
    assert [m.step for m in store.published("run")] == [1]

    rerun = store.publish(RunFolder("run", big_run), 2)
    assert rerun.skipped, "files already there are not uploaded again"
    assert rerun.aborted_uploads >= 0 and rerun.latest_moved and store.latest("run")["step"] == 2
    uploads = store.client.list_multipart_uploads(Bucket=store.bucket, Prefix=store.run_key("run") + "/")
    assert not uploads.get("Uploads"), "incomplete multipart uploads were aborted"


@pytest.mark.services
def test_restore_picks_the_newest_valid_published_checkpoint(big_run, store, tmp_path):
    store.publish(RunFolder("run", big_run), 1)
    store.publish(RunFolder("run", big_run), 2)
    # Damage step 2 in S3: a restore must skip it and take step 1.
    key = store.step_key("run", 2, "data.pt")
    store.client.put_object(Bucket=store.bucket, Key=key, Body=b"not what the manifest says")
    dest = tmp_path / "restored"
    r = relay_cli("checkpoint", "restore", store.uri, str(dest), "--run", "run")
    assert r.returncode == 0, r.stderr
    assert "restored step 1" in r.stdout and layout.read_tracker(dest) == 1
    assert admit_dir(dest).ok


@pytest.mark.services
def test_a_restore_fetches_each_file_in_ranges_in_place_and_refuses_a_changed_byte(big_run, store, tmp_path):
    """Files above the part size come back as concurrent ranged GETs written in place, bit for bit; the
    per-file checks run on each file as it is complete; one byte altered in S3 fails its file's CRC64NVME."""
    import filecmp

    from relay.common.errors import CheckpointError

    store.publish(RunFolder("run", big_run), 1)
    m = store.manifest("run", 1)
    ranges = []
    store.client.meta.events.register(
        "before-call.s3.GetObject", lambda params, **_: ranges.append(params.get("headers", {}).get("Range"))
    )
    seen = []
    store.download("run", m, tmp_path / "a", on_file=lambda rel, path: seen.append((rel, path.stat().st_size)))
    source = layout.step_dir(big_run, 1)
    assert all(filecmp.cmp(source / rel, tmp_path / "a" / rel, shallow=False) for rel in m.files)
    assert sorted(seen) == sorted((rel, f["size"]) for rel, f in m.files.items()), "each file checked once, whole"
    parts = sum(-(-f["size"] // store.part_size) for f in m.files.values() if f["size"] > store.part_size)
    assert sum(1 for r in ranges if r) == parts > len(m.files), ranges

    big = max(m.files, key=lambda rel: m.files[rel]["size"])
    data = bytearray((source / big).read_bytes())
    data[len(data) // 2] ^= 1  # the same size: only the checksum can tell
    store.client.put_object(Bucket=store.bucket, Key=store.step_key("run", 1, big), Body=bytes(data))
    with pytest.raises(CheckpointError, match=f"{big}: does not match its manifest"):
        store.download("run", m, tmp_path / "b")


def test_unreachable_s3_is_a_clear_error(small_run, tmp_path):
    import boto3
    from botocore.config import Config

    from relay.common.errors import StoreError

    client = boto3.client(
        "s3", endpoint_url="http://127.0.0.1:9", config=Config(retries={"max_attempts": 1}, connect_timeout=1)
    )
    run = shutil.copytree(small_run, tmp_path / "run")
    assert admit_dir(run, 1).ok
    with pytest.raises(StoreError, match="unreachable"):
        CheckpointStore(client, "s3://relay/x").publish(RunFolder("run", run), 1)


@pytest.mark.services
def test_retention_keeps_latest_milestones_and_waits_a_grace_period(tmp_path, store, small_run):
    run, small = tmp_path / "run", small_run
    for step in (10, 20, 30, 40, 50):
        shutil.copytree(small / "global_step_1", run / f"global_step_{step}")
        layout.write_tracker(run, step)
        assert admit_dir(run, step).ok
        store.publish(RunFolder("run", run), step)
    policy = CheckpointPolicy(keep_local=2, keep_published=2, milestone_every=20, delete_grace_minutes=10)
    published = {m.step for m in store.published("run")}

    deleted = retention.apply_local(run, policy, 50, published)
    assert deleted == [10, 30] and sorted(layout.step_dirs(run)) == [20, 40, 50]
    assert layout.relay_dir(run, "retention.json").is_file(), "the decision is recorded"

    now = time.time()
    first = retention.apply_published(store, "run", policy, 50, now=now)
    assert first["deleted"] == [] and first["pending"] == [10, 30], "deletions wait for the grace period"
    later = retention.apply_published(store, "run", policy, 50, now=now + 11 * 60)
    assert later["deleted"] == [10, 30]
    assert [m.step for m in store.published("run")] == [20, 40, 50]
    assert not objects(store, "run", 10)


@pytest.mark.services
def test_keep_best_keeps_the_best_steps_by_their_metric_across_chunks_and_processes(tmp_path, store, small_run):
    """keep_best {reward_mean, max, k: 2} with keep_local 1: the newest, and the two best by the metric of their
    step's metrics.jsonl row, locally and in S3; retention.json says why each is kept. A later chunk's publish, in
    a process of its own, ranks again from the run's files: a better step displaces the second best."""
    from relay.spec.run_spec import KeepBest

    run, small = tmp_path / "run", small_run
    reward = {10: 0.9, 20: 0.1, 30: 0.8, 40: 0.2, 50: 0.3, 60: 0.95}

    def trained(steps):
        with open(run / layout.METRICS, "a") as f:
            for step in steps:
                shutil.copytree(small / "global_step_1", run / f"global_step_{step}")
                layout.write_tracker(run, step)
                assert admit_dir(run, step).ok
                store.publish(RunFolder("run", run), step)
                f.write(json.dumps({"step": step, "reward_mean": reward[step], "loss": 0.0}) + "\n")

    run.mkdir()
    trained([10, 20, 30, 40, 50])  # chunk 1
    policy = CheckpointPolicy(
        keep_local=1, keep_published=1, delete_grace_minutes=0, keep_best=KeepBest(metric="reward_mean", mode="max", k=2)
    )
    published = {m.step for m in store.published("run")}
    assert retention.apply_local(run, policy, 100, published) == [20, 40]
    assert sorted(layout.step_dirs(run)) == [10, 30, 50]
    why = json.loads(layout.relay_dir(run, "retention.json").read_text())["why"]
    assert why["10"] == ["best reward_mean (max): #1 of 2, 0.9"] and why["30"] == ["best reward_mean (max): #2 of 2, 0.8"]
    assert why["50"] == ["among the newest 1", "the latest (the tracker's)"]
    assert retention.apply_published(store, "run", policy, 100, run_dir=run)["deleted"] == [20, 40]

    trained([60])  # chunk 2: its publish runs in a process of its own, from the run's files alone
    code = (
        "import sys, json; sys.path.insert(0, 'plugins'); from pathlib import Path; "
        "from relay.checkpoints import retention; from relay.spec.run_spec import CheckpointPolicy; "
        f"p = CheckpointPolicy.model_validate_json({policy.model_dump_json()!r}); "
        f"print(json.dumps(retention.apply_local(Path({str(run)!r}), p, 100, {{10, 30, 50, 60}})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [30, 50]  # 60 is the newest and the best; 10 next
    assert sorted(layout.step_dirs(run)) == [10, 60]


@pytest.mark.services
def test_a_changed_step_is_withdrawn_before_its_objects_are_replaced(tmp_path, store):
    """Step 2 published, then quarantined and trained again (other bytes): the re-publish takes down the
    old manifest and points latest back at step 1 first, so a publish killed after its uploads leaves S3
    with no manifest over bytes it does not list."""
    run = tmp_path / "run"
    for step in (1, 2):
        verl_checkpoint.make(run, step=step)
        assert admit_dir(run, step).ok
        store.publish(RunFolder("run", run), step)
    assert store.latest("run")["step"] == 2
    old = store.manifest("run", 2)
    shutil.rmtree(layout.step_dir(run, 2))
    verl_checkpoint.make(run, step=2, seed=1)  # trained again: other weights
    assert admit_dir(run, 2).ok
    code = (
        "import sys; sys.path.insert(0, 'plugins'); from pathlib import Path; "
        "from relay.s3.store import CheckpointStore, s3_client; from relay.runs.folder import RunFolder; "
        f"CheckpointStore(s3_client(), {store.uri!r}).publish(RunFolder('run', Path({str(run)!r})), 2)"
    )
    killed = subprocess.run(
        [PY, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "RELAY_FAULT_KILL_AT": "publish_files@2"},
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert store.manifest("run", 2) is None and store.latest("run")["step"] == 1
    assert [m.step for m in store.published("run")] == [1]
    store.publish(RunFolder("run", run), 2)
    new = store.manifest("run", 2)
    assert new.files != old.files and store.latest("run")["step"] == 2
    dest = tmp_path / "restored"
    assert restore(store, RunFolder("run", dest))[0] == 2 and admit_dir(dest, 2).ok
