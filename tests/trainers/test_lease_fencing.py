"""One writer per run: a trainer left alive from an earlier attempt cannot write once a newer attempt
holds the run's lease."""

import os
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
    orphan = subprocess.Popen(
        [PY, "-m", "relay", "train", str(spec), "--to-step", "60", "--checkpoint-dir", str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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


def test_a_writer_of_an_earlier_incarnation_is_refused_even_holding_the_same_token_number(tmp_path):
    """Tokens are bound to the incarnation they were taken in: after a fresh start whose new lease starts
    counting again (the old lease moved aside with its folder), the old writer's token 1 and the new run's
    token 1 are different tokens."""
    from relay.common.errors import LeaseLost
    from relay.preflight.prepare import archive_run
    from relay.runs.record import new_incarnation, write_record

    run_dir = tmp_path / "r"
    write_record(run_dir, {"version": 2, "run": "r", "incarnation": new_incarnation()})
    old = Lease(run_dir)
    old_token = old.acquire("old-incarnation-trainer")
    archive_run(run_dir)  # the fresh start: the folder, its lease with it, moved aside
    write_record(run_dir, {"version": 2, "run": "r", "incarnation": new_incarnation()})
    new_token = Lease(run_dir).acquire("new-incarnation-trainer")
    assert new_token == old_token == 1
    with pytest.raises(LeaseLost, match="incarnation"):
        old.check(old_token)
    with pytest.raises(LeaseLost):
        with old.commit(old_token):
            pass


def test_a_fresh_start_carries_the_token_counter_forward(tmp_path):
    """A fresh start's new lease goes on counting where the archived one stopped, so no token of the old
    life is ever handed out again."""
    from relay.preflight.prepare import prepare_run
    from relay.spec.run_spec import load_spec

    spec = load_spec(write_spec(tmp_path, name="again"), check_environment=False)
    prepare_run(spec, "again")
    run_dir = tmp_path / "ckpt" / "again"
    for _ in range(3):  # three attempts of the first life, each a process that has ended since
        subprocess.run(
            [PY, "-c", f"from relay.runs.lease import Lease; Lease({str(run_dir)!r}).acquire('attempt')"],
            cwd=ROOT,
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT / "plugins")},
        )
    (run_dir / "global_step_2").mkdir()  # something for the fresh start to move aside
    prepare_run(spec, "again", fresh_start=True, confirm="again")
    assert Lease(run_dir).acquire("the new life's first attempt") > 3
