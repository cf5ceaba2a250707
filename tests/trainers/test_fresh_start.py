"""A run is one run: a confirmed fresh start begins a new incarnation from step 0 and moves the old run
aside, locally and in S3, without deleting it; nothing of the old life is restored into the new one."""

import pytest

from relay.runs.record import read_record
from relay.s3.store import CheckpointStore, store_for_spec
from relay.spec.run_spec import load_spec
from support.helpers import assert_bitwise_equal, digests, model_state, read_metrics, relay_cli, train

pytestmark = pytest.mark.processes  # trainer jobs in processes of their own: not in the fast lane


@pytest.mark.services
def test_a_confirmed_fresh_start_from_the_cli_starts_again_and_keeps_the_old_run(baseline, tmp_path):
    spec_path, straight = baseline
    spec = load_spec(spec_path)
    run_dir = tmp_path / "again"
    train(spec_path, run_dir, 6)
    assert relay_cli("checkpoint", "publish", str(run_dir), spec.s3.uri).returncode == 0
    store = store_for_spec(spec)
    old = {
        "incarnation": read_record(run_dir)["incarnation"],
        "files": digests(run_dir / "global_step_6"),
        "manifest": store.manifest("again", 6),
    }

    refused = relay_cli("train", str(spec_path), "--to-step", "12", "--checkpoint-dir", str(run_dir), "--fresh-start")
    assert refused.returncode != 0 and "fresh start of run 'again' refused" in refused.stderr
    assert "--confirm" in refused.stderr and "published checkpoints under" in refused.stderr
    assert (run_dir / "global_step_6").is_dir() and store.manifest("again", 6) is not None, "nothing moved"

    r = relay_cli(
        "train", str(spec_path), "--to-step", "12", "--checkpoint-dir", str(run_dir), "--fresh-start", "--confirm", "again"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumes from scratch (step 0)" in r.stdout and "moved aside" in r.stdout
    assert read_record(run_dir)["incarnation"] != old["incarnation"], "a new incarnation"
    assert [x["step"] for x in read_metrics(run_dir)] == list(range(1, 13))
    assert_bitwise_equal(model_state(run_dir / "global_step_12"), model_state(straight / "global_step_12"))

    # The old run is still there, untouched: its folder in .archive, its objects under <prefix>/.archive/.
    (archived,) = (run_dir.parent / ".archive").iterdir()
    assert digests(archived / "global_step_6") == old["files"]
    assert read_record(archived)["incarnation"] == old["incarnation"]
    assert store.steps("again") == [] and store.latest("again") is None, "nothing of the old life under again/"
    aside = CheckpointStore(store.client, f"{spec.s3.uri}/.archive")
    kept = aside.manifest(archived.name, 6)
    assert kept.files == old["manifest"].files and kept.incarnation == old["incarnation"]
    aside.verify(archived.name, kept)  # every object: the size and CRC64NVME the manifest records


def test_train_with_s3_unreachable_says_that_offline_exists(tmp_path):
    """`relay train` looks at the run's published incarnation; with S3 unreachable it says so, and that
    --offline trains without it. Nothing is written in the checkpoint folder."""
    from support.helpers import write_spec
    from support.ports import free_port

    spec_path = write_spec(tmp_path, name="away")
    r = relay_cli(
        "train",
        str(spec_path),
        "--to-step",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "away"),
        env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_MAX_ATTEMPTS": "1"},
    )
    assert r.returncode != 0 and "unreachable" in r.stderr and "--offline" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "away" / "global_step_2").exists()
    offline = relay_cli(
        "train",
        str(spec_path),
        "--to-step",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "away"),
        "--offline",
        env={"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"},
    )
    assert offline.returncode == 0, offline.stderr[-2000:]
    # step 2 is inside chunk 1 (chunks of 6): its lines name that chunk, not "chunk -"
    assert "chunk 1 resumes from scratch (step 0), trains to step 2 of 12" in offline.stdout, offline.stdout[-2000:]
    assert "step 2/12 chunk 1 " in offline.stdout and "chunk -" not in offline.stdout


def test_a_fresh_start_under_a_live_trainer_is_refused_and_an_unseen_old_writer_is_fenced_out(tmp_path):
    """`relay train --fresh-start` never archives a run under a live writer: it refuses, naming its host and pid.
    A writer this host cannot see (its lease says another host) does not stop the fresh start, and it is fenced
    out of the new incarnation: it exits 3 and writes nothing into the new folder (no metrics row, event,
    staging folder, checkpoint or tracker)."""
    import json
    import socket

    from relay.common.faultpoint import FAULT_ENV
    from relay.runs import layout
    from relay.runs.lease import Lease
    from relay.runs.metrics import read_events
    from support.faults import ForkServer, alive, wait_for_line
    from support.helpers import write_spec

    spec = write_spec(tmp_path, name="live", total_steps=12, chunk_steps=12, **{"trainer.settings.save_freq": 2})
    run_dir = tmp_path / "ckpt" / "live"
    server = ForkServer()
    try:
        log, once = tmp_path / "old.log", tmp_path / "old.once"
        old = server.start(
            ["train", str(spec), "--to-step", "12", "--offline"],
            log,
            env={FAULT_ENV: "after_step@3", "RELAY_FAULT_ONCE": str(once)},
        )
        wait_for_line(log, "[relay-fault] paused", old)
        old_attempt = Lease(run_dir).current()["holder"]

        fresh = ["train", str(spec), "--to-step", "2", "--offline", "--fresh-start", "--confirm", "live"]
        refused = relay_cli(*fresh)
        assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert f"pid {old}" in refused.stderr and socket.gethostname() in refused.stderr, refused.stderr[-2000:]
        assert not (run_dir.parent / ".archive").exists() and layout.read_tracker(run_dir) == 2, "nothing moved"

        # The same writer as if it ran on another node: this host cannot see its pid, the fresh start goes on.
        lease = json.loads(Lease(run_dir).path.read_text())
        Lease(run_dir).path.write_text(json.dumps({**lease, "host": "gpu-node-7"}))
        started = relay_cli(*fresh)
        assert started.returncode == 0, started.stderr[-3000:]
        assert "gpu-node-7" in started.stdout + started.stderr, "the unseen writer is named"
        new_rows = read_metrics(run_dir)
        assert [r["step"] for r in new_rows] == [1, 2]

        once.with_name(once.name + ".go").touch()  # the old trainer goes on: step 4, then its save
        assert server.wait(old) == 3, log.read_text()[-3000:]
        assert "refusing to write" in log.read_text() and not alive(old)
    finally:
        server.close()
    assert layout.read_tracker(run_dir) == 2 and sorted(layout.step_dirs(run_dir)) == [2]
    assert read_metrics(run_dir) == new_rows, "no row of the old writer"
    assert not any(e.get("attempt") == old_attempt for e in read_events(run_dir)), "no event of the old writer"
    staging = layout.relay_dir(run_dir, "staging")
    assert not staging.exists() or not any(staging.iterdir()), "no staging folder of the old writer"
