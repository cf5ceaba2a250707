"""Writers of a run folder that never wait forever, never lose a line, and leftovers that do not pile up."""

import os
import subprocess
import sys
import threading

import pytest

from relay.checkpoints import retention
from relay.common.errors import RelayError
from relay.common.faultpoint import KILL_ENV, drill_env
from relay.common.filelock import LockTimeout, file_lock
from relay.runs import layout
from relay.runs.lease import Lease
from relay.runs.metrics import read_events, record_event
from relay.spec.run_spec import CheckpointPolicy
from support.polling import wait_for

PLUGINS = os.path.join(os.path.dirname(__file__), "..", "..", "plugins")


def _hold_in_another_process(lock, what: str) -> subprocess.Popen:
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
        "from relay.common.filelock import file_lock\n"
        "with file_lock(Path(sys.argv[2]), sys.argv[3]):\n print('held', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code, PLUGINS, str(lock), what], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_writer_gives_up_after_its_wait_and_names_the_holder(tmp_path):
    lock = tmp_path / ".relay" / "lease.lock"
    holder = _hold_in_another_process(lock, "committing step 40")
    try:
        with pytest.raises(LockTimeout) as e:
            with Lease(tmp_path, timeout=0.5).locked("quarantining step 40"):
                pytest.fail("the lock was held by another process")
        assert f"pid {holder.pid}" in e.value.what and "committing step 40" in e.value.what
        assert "held for more than 0.5 s" in e.value.what and "quarantining step 40" in e.value.what
        assert "did not wait longer" in e.value.what and "retry" in e.value.fix
    finally:
        holder.kill()
        holder.wait()
    with Lease(tmp_path, timeout=0.5).locked("quarantining step 40"):  # a killed holder holds nothing
        pass


def test_the_lock_is_reentrant_in_one_thread_and_exclusive_across_threads(tmp_path):
    lock = tmp_path / "x.lock"
    order = []
    with file_lock(lock, "outer"):
        with file_lock(lock, "inner (a restore inside a resume)"):
            order.append("nested")
        t = threading.Thread(target=lambda: (file_lock(lock, "other").__enter__(), order.append("other")))
        t.start()
        t.join(0.3)
        assert t.is_alive() and order == ["nested"]  # the other thread waits for the outer hold to end
    t.join(5)
    assert order == ["nested", "other"]


def test_an_event_after_a_torn_line_is_not_lost(tmp_path, capsys):
    record_event(tmp_path, "chunk_start", chunk=1)
    with open(tmp_path / layout.EVENTS, "a") as f:
        f.write('{"event": "chunk_end", "chu')  # a writer killed mid-line
    record_event(tmp_path, "chunk_start", chunk=2, resumed_from=10)
    assert [(e["event"], e.get("chunk")) for e in read_events(tmp_path)] == [("chunk_start", 1), ("chunk_start", 2)]
    assert "1 unreadable line(s) skipped" in capsys.readouterr().err
    assert '"chu\n' in (tmp_path / layout.EVENTS).read_text()  # the torn line is kept, on a line of its own


WRITER = """
import contextlib, pathlib, sys, time
sys.path.insert(0, sys.argv[1])
from relay.runs import metrics
if sys.argv[4] == "unlocked":  # the control: the same writer without its lock
    metrics.file_lock = lambda *a, **k: contextlib.nullcontext()
run_dir = pathlib.Path(sys.argv[2])
(run_dir.parent / f"{run_dir.name}.ready.{sys.argv[5]}").touch()
while not (run_dir.parent / f"{run_dir.name}.go").exists():  # every writer starts at once
    time.sleep(0.001)
for k in range(int(sys.argv[3])):
    metrics.record_event(run_dir, "save", writer=sys.argv[5], k=k, pad="x" * 6000)
"""


def _write_events_from_processes(run_dir, lock: str, writers: int = 4, each: int = 150) -> list[dict]:
    run_dir.mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, PLUGINS, str(run_dir), str(each), lock, str(w)])
        for w in range(writers)
    ]
    wait_for(
        lambda: all((run_dir.parent / f"{run_dir.name}.ready.{w}").exists() for w in range(writers)),
        60,
        "every writer to be ready",
    )
    (run_dir.parent / f"{run_dir.name}.go").touch()
    for p in procs:
        assert p.wait(60) == 0
    return read_events(run_dir)


def test_events_from_many_processes_are_whole_lines_and_none_is_lost(tmp_path, capsys):
    """Writers on several hosts share events.jsonl (a trainer on a Ray node, the gate in an Airflow worker), where
    an append is not atomic (NFS): each line, longer than PIPE_BUF here, is written at the file's end under the
    run folder's lock. Without the lock, the same writers lose lines."""
    events = _write_events_from_processes(tmp_path / "locked", "locked")
    assert sorted((e["writer"], e["k"]) for e in events) == [(str(w), k) for w in range(4) for k in range(150)]
    assert all(len(e["pad"]) == 6000 for e in events)
    for w in range(4):
        assert [e["k"] for e in events if e["writer"] == str(w)] == list(range(150)), "each writer's lines in order"
    assert "unreadable" not in capsys.readouterr().err

    # The control: the same writers without the lock lose lines (a few rounds: on a busy machine one round's
    # writers may happen not to overlap).
    for i in range(5):
        if len(_write_events_from_processes(tmp_path / f"unlocked{i}", "unlocked")) < 4 * 150:
            break
    else:
        pytest.fail("the control: without the lock, lines are lost")


def _step(folder, step, *, actor=True):
    p = folder / f"global_step_{step}"
    (p / "actor" if actor else p).mkdir(parents=True)
    return p


def test_leftovers_go_once_s3_holds_their_step_and_never_the_only_copy(tmp_path):
    run = tmp_path / "run"
    superseded = _step(layout.relay_dir(run, "superseded"), 10)
    quarantined = layout.relay_dir(run, "quarantine") / "global_step_20.1764550000"
    quarantined.mkdir(parents=True)
    (layout.relay_dir(run, "quarantine") / "global_step_20.1764550000.report.json").write_text("{}")
    rollout_unpublished = _step(layout.relay_dir(run, "rollout_state"), 30)
    hf = run / layout.HF_DIR
    hf_old, hf_new = _step(hf, 10), _step(hf, 20)
    for s in (10, 20, 30):
        _step(run, s)
    layout.write_tracker(run, 30)
    assert retention.leftovers(run, published={10, 20}) == [superseded, quarantined, hf_old]
    retention.apply_local(run, CheckpointPolicy(keep_local=3), total_steps=100, published={10, 20})
    assert not superseded.exists() and not quarantined.exists() and not hf_old.exists()
    assert rollout_unpublished.exists() and hf_new.exists()  # step 30 is in no other place; the newest export stays
    assert (layout.relay_dir(run, "quarantine") / "global_step_20.1764550000.report.json").exists()
    assert [e for e in read_events(run) if e["event"] == "retention"][-1]["aside"] == [
        ".relay/superseded/global_step_10",
        ".relay/quarantine/global_step_20.1764550000",
        "hf/global_step_10",
    ]


@pytest.mark.parametrize(
    "drill",
    [
        {"kill_at": "after_step"},
        {"kill_at": "nowhere@3"},
        {"kill": "after_step@3"},
        "after_step@3",
        {"kill_at": "after_step@3", "also": 1},
    ],
)
def test_a_drill_that_relay_does_not_run_is_refused_in_words(tmp_path, drill):
    with pytest.raises(RelayError, match="is not a drill Relay runs") as e:
        drill_env(drill, tmp_path / "once")
    assert "after_step@34" in e.value.fix


def test_a_drill_arms_one_kill(tmp_path):
    env = drill_env({"kill_at": "after_step@034"}, tmp_path / "d" / "once")
    assert env == {KILL_ENV: "after_step@34", "RELAY_FAULT_ONCE": str(tmp_path / "d" / "once")}
