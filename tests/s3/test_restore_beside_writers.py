"""A restore beside the run's other writers: it moves the tracker only if no writer committed while it downloaded,
and the history it brings back (relay.s3.history) keeps every event written meanwhile, in the order they happened."""

import json
import os
import subprocess
import time
import uuid

import pytest

from relay.common.faultpoint import FAULT_ENV
from relay.common.timestamps import epoch, event_time
from relay.runs import layout
from relay.runs.folder import RunFolder
from relay.runs.metrics import read_events
from relay.s3 import history
from relay.s3.store import CheckpointStore, s3_client
from relay.spec.run_spec import load_spec
from support.faults import wait_for_line
from support.helpers import PY, ROOT, relay_cli, train, write_spec
from support.polling import wait_for

# The train task's phase marks, as fast as a process writes them, until told to stop; it prints how many it wrote.
WRITER = """
import sys, pathlib
from relay.runs.metrics import record_event
run_dir, stop = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
n = 0
while not stop.exists():
    record_event(run_dir, "phase", phase="submit", by="the train task", n=n)
    n += 1
print(n)
"""


@pytest.mark.services
@pytest.mark.fault
def test_events_written_during_a_restore_are_kept_and_merged_in_time_order(tmp_path, fault_row):
    store = CheckpointStore(s3_client(), f"s3://relay/test-history-{uuid.uuid4().hex[:10]}")
    run_dir = tmp_path / "r"
    layout.relay_dir(run_dir).mkdir(parents=True)
    # What another host published: its events of an hour ago, one of them with the epoch seconds Ray records.
    base = time.time() - 3600
    published = [{"event": "phase", "phase": "train", "n": i, "time": event_time(base + i / 100)} for i in range(20000)]
    published.insert(0, {"event": "job", "status": "SUCCEEDED", "time": base + 150.0})
    store.put_bytes(
        store.run_key("r", layout.EVENTS),
        "".join(json.dumps(e) + "\n" for e in published).encode(),
        "application/x-ndjson",
    )
    stop = tmp_path / "stop"
    writer = subprocess.Popen(
        [PY, "-c", WRITER, str(run_dir), str(stop)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "plugins")},
    )
    try:
        wait_for(lambda: len(read_events(run_dir)) > 10, 60, "the train task's first phase marks")
        assert layout.EVENTS in history.restore(store, RunFolder("r", run_dir), 6)
        time.sleep(0.5)  # a few more marks after the restore
    finally:
        stop.touch()
        written = int(writer.communicate(timeout=60)[0])
    events = read_events(run_dir)
    assert sorted(e["n"] for e in events if e.get("by") == "the train task") == list(range(written)), "none lost"
    assert len(events) == written + len(published), "every published event, once"
    times = [epoch(e["time"]) for e in events]
    assert times == sorted(times), "in the order they happened, ISO times and epoch seconds alike"
    fault_row(
        case="restore-during-marks",
        fault="a restore of the run's history while the train task writes its phase marks",
        action=f"merged S3's {len(published)} events with the folder's under the events' lock: all {written} marks "
        "written meanwhile kept, in time order",
        steps_lost=0,
        layer="s3",
        run_dir=run_dir,
        store=store,
    )


@pytest.mark.services
def test_a_restore_never_moves_the_tracker_behind_a_checkpoint_committed_meanwhile(tmp_path):
    spec_path = write_spec(tmp_path, name="r", **{"trainer.settings.save_freq": 2})
    spec = load_spec(spec_path, check_environment=False)
    run_dir = spec.run_dir("r")
    train(spec_path, run_dir, 4)
    assert relay_cli("checkpoint", "publish", str(run_dir), spec.s3.uri).returncode == 0
    once, log = tmp_path / "restore.once", tmp_path / "restore.log"
    # A restore that holds no token of its own (as a trainer's restore_for_resume, or the gate's fallback, moves the
    # tracker): only its compare-and-swap keeps it from hiding step 6.
    code = (
        "import sys; from pathlib import Path; from relay.runs.folder import RunFolder; from relay.s3.restore import "
        "restore; from relay.s3.store import CheckpointStore, s3_client; "
        "sys.exit(0 if restore(CheckpointStore(s3_client(), sys.argv[1]), RunFolder('r', Path(sys.argv[2]))) else 1)"
    )
    with open(log, "w") as out:
        restoring = subprocess.Popen(
            [PY, "-c", code, spec.s3.uri, str(run_dir)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, FAULT_ENV: "restore_downloaded", "RELAY_FAULT_ONCE": str(once)},
        )
    wait_for_line(log, "[relay-fault] paused at restore_downloaded", restoring.pid)
    train(spec_path, run_dir, 6)  # the run's trainer commits step 6 while the restore holds step 4's download
    once.with_name(once.name + ".go").touch()
    assert restoring.wait(timeout=120) != 0, log.read_text()[-2000:]
    said = log.read_text()
    assert "its tracker named step 4 when the restore began and names step 6 now" in said, said[-2000:]
    assert layout.read_tracker(run_dir) == 6 and (run_dir / "global_step_6").is_dir(), "step 6 is still the latest"
    assert not any(layout.relay_dir(run_dir, "staging").glob("restore-*")), "the download was removed"


@pytest.mark.services
def test_a_manual_restore_is_refused_under_a_live_trainer_and_with_force_fences_it_out(tmp_path):
    from support.faults import ForkServer

    spec_path = write_spec(tmp_path, name="r", **{"trainer.settings.save_freq": 2})
    spec = load_spec(spec_path, check_environment=False)
    run_dir = spec.run_dir("r")
    train(spec_path, run_dir, 2)
    assert relay_cli("checkpoint", "publish", str(run_dir), spec.s3.uri).returncode == 0
    server = ForkServer()
    try:
        log, once = tmp_path / "trainer.log", tmp_path / "trainer.once"
        trainer = server.start(
            ["train", str(spec_path), "--to-step", "6", "--offline"],
            log,
            env={FAULT_ENV: "after_step@3", "RELAY_FAULT_ONCE": str(once)},
        )
        wait_for_line(log, "[relay-fault] paused", trainer)
        refused = relay_cli("checkpoint", "restore", spec.s3.uri, str(run_dir))
        assert refused.returncode == 1 and f"pid {trainer}" in refused.stderr, refused.stderr[-2000:]
        assert "--force" in refused.stderr and "refused: the run has a live writer" in refused.stderr

        forced = relay_cli("checkpoint", "restore", spec.s3.uri, str(run_dir), "--force")
        assert forced.returncode == 0, forced.stderr[-2000:]
        once.with_name(once.name + ".go").touch()
        assert server.wait(trainer) == 3, log.read_text()[-2000:]  # fenced out: its step-4 save is refused
    finally:
        server.close()
    assert layout.read_tracker(run_dir) == 2 and not (run_dir / "global_step_4").exists()
