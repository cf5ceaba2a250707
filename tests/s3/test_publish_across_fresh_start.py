"""A publication in flight when a fresh start moves the run aside leaves nothing of the old incarnation under the
run's prefix: the manifest, latest.json and the run's history are written only while the run is still its
incarnation's, and whatever of them a fresh start overtook is taken back. Real processes, the real lock, the
session's S3 server."""

import os
import shutil
import subprocess
import time

import pytest

from relay.checkpoints.gate import admit_dir
from relay.preflight.prepare import decide_fresh_start, prepare_run
from relay.s3.store import CheckpointStore, s3_client
from relay.spec.run_spec import load_spec
from support import verl_checkpoint
from support.helpers import PY, ROOT, write_spec

pytestmark = pytest.mark.services


def _keys(store: CheckpointStore, prefix: str) -> list[str]:
    r = store.client.list_objects_v2(Bucket=store.bucket, Prefix=prefix)
    return sorted(o["Key"][len(prefix) :] for o in r.get("Contents", []))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Steps 1 and 2 of the old incarnation, and another step 1 (the new incarnation's), made once."""
    made = tmp_path_factory.mktemp("made")
    verl_checkpoint.make_many(
        [
            {"run_dir": made / "old", "step": 1},
            {"run_dir": made / "old", "step": 2, "seed": 1},
            {"run_dir": made / "new", "step": 1, "seed": 2},
        ]
    )
    return made


def _copy(made, which: str, step: int, run_dir) -> None:
    shutil.copytree(made / which / f"global_step_{step}", run_dir / f"global_step_{step}")
    assert admit_dir(run_dir, step).ok


@pytest.mark.parametrize(
    ("paused_at", "fresh_start"),
    [
        ("publish_files", "finished"),  # the whole fresh start runs while the files are uploaded
        ("publish_manifest", "decided"),  # decided after the manifest's PUT; S3 moved after the publish gave up
    ],
)
@pytest.mark.fault
def test_a_publication_overtaken_by_a_fresh_start_leaves_nothing_under_the_new_incarnation(
    tmp_path, s3_server, checkpoints, paused_at, fresh_start, fault_row
):
    spec = load_spec(write_spec(tmp_path, name="r"), check_environment=False)
    store = CheckpointStore(s3_client(), spec.s3.uri)
    old = prepare_run(spec, "r", store=store).run(spec)
    _copy(checkpoints, "old", 1, old.dir)
    _copy(checkpoints, "old", 2, old.dir)
    store.publish(old.folder, 1)  # the old incarnation's publication the fresh start moves aside

    once = tmp_path / "paused"
    env = {**os.environ, "RELAY_FAULT_PAUSE_AT": f"{paused_at}@2", "RELAY_FAULT_ONCE": str(once)}
    cmd = [PY, "-m", "relay", "checkpoint", "publish", str(old.dir), spec.s3.uri, "--step", "2", "--run", "r"]
    publishing = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not once.exists() and publishing.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert once.exists(), publishing.communicate()
    if fresh_start == "finished":
        prepare_run(spec, "r", fresh_start=True, confirm="r", store=store, asked_by="DAG run d/new")
    else:
        decide_fresh_start(old, "DAG run d/new")
    (tmp_path / "paused.go").touch()
    out, err = publishing.communicate(timeout=120)
    assert publishing.returncode == 3, (out, err)  # lease lost: the publication was for the old incarnation
    assert f"is for incarnation {old.incarnation}" in err or "a fresh start that DAG run d/new decided" in err, err
    new = prepare_run(spec, "r", fresh_start=True, confirm="r", store=store, asked_by="DAG run d/new")
    assert new.incarnation != old.incarnation

    under_run = _keys(store, store.run_key("r") + "/")
    commits = [k for k in under_run if k.endswith(("relay_manifest.json", "latest.json", "run.json", ".jsonl"))]
    assert commits == [], f"the old incarnation's publication landed under the new one's prefix: {commits}"
    assert store.incarnation("r") is None and store.published("r") == []
    archived = [k for k in _keys(store, f"{store.prefix}/.archive/") if k.endswith("relay_manifest.json")]
    assert [k.split("/", 1)[1] for k in archived] == ["global_step_1/relay_manifest.json"], archived

    # The new incarnation publishes under its name as if the old one had never been there.
    new_run = new.run(spec)
    _copy(checkpoints, "new", 1, new_run.dir)
    store.publish(new_run.folder, 1)
    assert store.latest("r")["step"] == 1 and [m.incarnation for m in store.published("r")] == [new.incarnation]
    where = "its files uploaded" if paused_at == "publish_files" else "its manifest written, latest.json not yet"
    fault_row(
        case="publish-across-fresh-start",
        fault=f"a publication of the old incarnation paused ({where}) while a fresh start was {fresh_start}",
        action="the publication refused (lease lost, exit 3) before or after its writes, which it took back: no "
        "manifest, latest.json or history of the old incarnation under the run's prefix; the new incarnation "
        "published as if it had never been there",
        steps_lost=0,
        layer="s3",
        run_dir=new_run.dir,
        store=store,
    )
