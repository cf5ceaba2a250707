import json

import pytest

from relay.common.errors import CheckpointError, LeaseLost
from relay.runs import layout
from relay.runs.lease import Lease
from relay.runs.metrics import MetricsLog


def test_tracker_round_trip_and_garbage(tmp_path):
    assert layout.read_tracker(tmp_path) is None
    layout.write_tracker(tmp_path, 40)
    assert layout.read_tracker(tmp_path) == 40
    assert not list(tmp_path.glob(".*.tmp"))
    layout.tracker_path(tmp_path).write_bytes(b"4\x00\xff")
    with pytest.raises(CheckpointError, match="not a step number"):
        layout.read_tracker(tmp_path)


def test_rotation_leftovers_are_not_checkpoints(tmp_path):
    empty = tmp_path / "global_step_1"
    empty.mkdir()
    data_only = tmp_path / "global_step_2"
    data_only.mkdir()
    (data_only / "data.pt").write_bytes(b"x")
    real = tmp_path / "global_step_3"
    (real / "actor").mkdir(parents=True)
    assert layout.is_rotation_leftover(empty) and layout.is_rotation_leftover(data_only)
    assert not layout.is_rotation_leftover(real)
    assert list(layout.step_dirs(tmp_path)) == [1, 2, 3]


def test_lease_tokens_fence_older_holders(tmp_path):
    lease = Lease(tmp_path)
    t1 = lease.acquire("attempt-1")
    lease.check(t1)
    t2 = lease.acquire("attempt-2")
    assert t2 == t1 + 1
    with pytest.raises(LeaseLost, match="attempt-2"):
        lease.check(t1)
    with pytest.raises(LeaseLost):
        with lease.commit(t1):
            pytest.fail("an older token must not enter a commit")
    with lease.commit(t2):
        pass


def test_metrics_keep_one_row_per_step_after_a_resume(tmp_path):
    log = MetricsLog(tmp_path)
    for step in range(1, 8):
        log.append({"step": step, "attempt": "a1"})
    log.close()
    with open(log.path, "a") as f:
        f.write('{"step": 8, "attem')  # torn last line of a killed writer
    assert log.resume_at(5, "a2") == 2
    assert [r["step"] for r in log.rows()] == [1, 2, 3, 4, 5]
    superseded = [json.loads(x) for x in log.superseded_path.read_text().splitlines()]
    assert [(r["step"], r["superseded_by"]) for r in superseded] == [(6, "a2"), (7, "a2")]
