"""One writer per run: a trainer left alive from an earlier attempt cannot write once a newer attempt
holds the run's lease."""

import subprocess
import time

import pytest

from relay.runs import layout
from relay.runs.lease import Lease
from support.helpers import PY, ROOT, read_metrics, write_spec


@pytest.mark.services
def test_an_orphaned_trainer_stops_without_saving_once_the_lease_moves(tmp_path):
    spec = write_spec(tmp_path, total_steps=60, chunk_steps=60, **{"trainer.settings.save_freq": 2})
    run_dir = tmp_path / "ckpt" / "orphan"
    orphan = subprocess.Popen([PY, "-m", "relay", "train", str(spec), "--to-step", "60", "--checkpoint-dir",
                               str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and (layout.read_tracker(run_dir) or 0) < 4:
        time.sleep(0.02)
    token = Lease(run_dir).acquire("newer-attempt")  # what the next attempt's trainer does first
    tracker_at_takeover = layout.read_tracker(run_dir)
    out, _ = orphan.communicate(timeout=120)

    assert orphan.returncode == 3, out[-3000:]
    assert "refusing to write" in out and "newer-attempt" in out
    # At most the step in flight was logged; nothing was committed after the takeover.
    assert layout.read_tracker(run_dir) == tracker_at_takeover
    assert max(layout.step_dirs(run_dir)) == tracker_at_takeover
    assert max(r["step"] for r in read_metrics(run_dir)) <= tracker_at_takeover + 2
    assert Lease(run_dir).current()["token"] == token
