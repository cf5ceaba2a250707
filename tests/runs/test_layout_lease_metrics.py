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


def test_the_verl_drivers_progress_lines_read_only_what_was_appended(tmp_path, capsys):
    """verl's driver prints a step line for every metrics row its trainer actor writes, polling metrics.jsonl: each
    poll reads what was appended since the last one, not the whole file (each row carries the step's sample
    indices), and a row being written is printed once it is whole."""
    import json
    import types

    from relay.trainers.verl_ppo.trainer import ProgressWatcher

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"

    def row(step):
        return json.dumps({"step": step, "attempt": "a", "seconds": 1.0, "sample_indices": list(range(2000))}) + "\n"

    metrics.write_text("".join(row(s) for s in range(1, 201)))  # 200 earlier steps, about 2 MB
    session = types.SimpleNamespace(
        run_dir=run_dir,
        req=types.SimpleNamespace(attempt="a", chunk=1),
        spec=types.SimpleNamespace(total_steps=1000),
        say=print,
    )
    watcher = ProgressWatcher(session, start=200, end=210, poll_s=3600)
    try:
        assert watcher.poll() == []
        before = watcher.metrics.bytes_read
        with open(metrics, "a") as f:
            f.write(row(201))
            f.write(row(202)[:100])  # half a row: its writer is in the middle of it
        assert watcher.poll() == [201]
        assert watcher.metrics.bytes_read - before < 2 * len(row(202)), "a poll reads what was appended"
        with open(metrics, "a") as f:
            f.write(row(202)[100:])
        assert watcher.poll() == [202]
    finally:
        watcher.stop()
    assert "step 201/1000" in capsys.readouterr().out
