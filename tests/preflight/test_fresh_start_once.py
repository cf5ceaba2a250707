"""A fresh start happens once per decision: a DAG run cleared after a newer fresh start continues the run, two
fresh starts never share an archive, and a fresh start refuses before anything moves or, once decided, is
finished by whoever comes next, with every older writer fenced out meanwhile."""

import os
import subprocess

import pytest

from relay.common.errors import LeaseLost
from relay.common.faultpoint import KILL_ENV
from relay.preflight.prepare import prepare_run
from relay.runs import layout
from relay.runs.lease import Lease
from relay.runs.record import read_record
from relay.spec.run_spec import load_spec
from support.helpers import PY, ROOT, relay_cli, train, write_spec


def _prepared(tmp_path, name="r", **overrides):
    spec_path = write_spec(tmp_path, name=name, **overrides)
    spec = load_spec(spec_path, check_environment=False)
    prepare_run(spec, name)
    return spec_path, spec, tmp_path / "ckpt" / name


def _archives(tmp_path) -> list:
    aside = tmp_path / "ckpt" / ".archive"
    return sorted(aside.iterdir()) if aside.is_dir() else []


@pytest.mark.fault
def test_a_dag_run_cleared_after_a_newer_fresh_start_continues_the_run(tmp_path, fault_row):
    _, spec, run_dir = _prepared(tmp_path)
    (run_dir / "global_step_2").mkdir()
    prepare_run(spec, "r", fresh_start=True, confirm="r", asked_by="DAG run d/X")
    (run_dir / "global_step_2").mkdir()
    newer = prepare_run(spec, "r", fresh_start=True, confirm="r", asked_by="DAG run d/Y")
    (run_dir / "global_step_4").mkdir()  # Y's incarnation trains on

    cleared = prepare_run(spec, "r", fresh_start=True, confirm="r", asked_by="DAG run d/X")
    assert cleared.incarnation == newer.incarnation and cleared.archived_to is None
    assert any("DAG run d/X already started run r again" in n for n in cleared.notes), cleared.notes
    assert (run_dir / "global_step_4").is_dir() and len(_archives(tmp_path)) == 2, "nothing more moved"
    starts = read_record(run_dir)["fresh_starts"]
    assert [s["asked_by"] for s in starts] == ["DAG run d/X", "DAG run d/Y"]
    assert {s["archived_to"] for s in starts} == {str(p) for p in _archives(tmp_path)}, "each says what it moved"
    fault_row(
        case="dag-run-cleared",
        fault="a DAG run that performed a fresh start cleared after a newer DAG run started the run again",
        action="found its fresh start in the run record's list of fresh starts and continued the newer incarnation; "
        "nothing archived",
        steps_lost=0,
        layer="preflight",
        run_dir=run_dir,
    )


def test_fresh_starts_within_one_second_keep_an_archive_each(tmp_path):
    _, spec, run_dir = _prepared(tmp_path)
    moved = []
    for who in ("a", "b", "c"):
        (run_dir / "global_step_2").mkdir()
        (run_dir / "global_step_2" / "who").write_text(who)
        moved.append(prepare_run(spec, "r", fresh_start=True, confirm="r", asked_by=who).archived_to)
    assert len(set(moved)) == 3 and [p.name for p in _archives(tmp_path)] == sorted(os.path.basename(m) for m in moved)
    assert sorted((p / "global_step_2" / "who").read_text() for p in _archives(tmp_path)) == ["a", "b", "c"]


def _prepare_in_a_process(spec_path, env: dict, *args: str) -> subprocess.CompletedProcess:
    code = (
        "import sys; from relay.preflight.prepare import prepare_run; from relay.s3.store import store_for_spec; "
        "from relay.spec.run_spec import load_spec; spec = load_spec(sys.argv[1], check_environment=False); "
        "prepare_run(spec, 'r', fresh_start=True, confirm='r', asked_by='DAG run d/X', store=store_for_spec(spec))"
    )
    return subprocess.run(
        [PY, "-c", code, str(spec_path), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "plugins"), **env},
    )


@pytest.mark.services
@pytest.mark.fault
def test_a_fresh_start_killed_between_its_s3_archive_and_its_local_move_is_finished_by_the_next_prepare(tmp_path, fault_row):
    from relay.s3.store import CheckpointStore, store_for_spec
    from support.faults import data_lost

    spec_path, spec, run_dir = _prepared(tmp_path, **{"trainer.settings.save_freq": 2})
    train(spec_path, run_dir, 2)
    assert relay_cli("checkpoint", "publish", str(run_dir), spec.s3.uri).returncode == 0
    store = store_for_spec(spec)
    old = read_record(run_dir)["incarnation"]
    old_token = Lease(run_dir).current()["token"]

    killed = _prepare_in_a_process(spec_path, {KILL_ENV: "fresh_start_archived"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert store.latest("r") is None and layout.read_tracker(run_dir) == 2, "S3 moved aside, the folder not yet"
    # The decision fences every older writer out and hands no token to a submission until it is finished.
    with pytest.raises(LeaseLost, match="refusing to write"):
        Lease(run_dir, incarnation=old).check(old_token)
    with pytest.raises(LeaseLost, match="a fresh start that DAG run d/X decided"):
        Lease(run_dir).acquire("a chunk's job submitted meanwhile")

    finished = prepare_run(spec, "r", store=store)  # the next trigger, whoever it is, finishes the decision
    assert any("finishing the fresh start of run r that DAG run d/X decided" in n for n in finished.notes)
    assert finished.incarnation != old and finished.latest_step == 0
    (archived,) = _archives(tmp_path)
    assert finished.archived_to == str(archived) and finished.archived_uri.endswith(f"/.archive/{archived.name}/")
    assert [s["asked_by"] for s in read_record(run_dir)["fresh_starts"]] == ["DAG run d/X"]
    assert Lease(run_dir).acquire("the new incarnation's first chunk") > old_token + 1
    aside = CheckpointStore(store.client, f"{spec.s3.uri}/.archive")
    assert [m.step for m in aside.published(archived.name)] == [2] and layout.read_tracker(archived) == 2
    fault_row(
        case="fresh-start-interrupted",
        fault="a fresh start's process SIGKILLed between its S3 archive and its local move",
        action="the decision, recorded under the run's lock before anything moved, fenced the old incarnation's "
        "writers and refused new submissions; the next prepare finished the same fresh start into the same "
        "archive, locally and in S3",
        steps_lost=0,
        layer="preflight",
        run_dir=archived,
        store=aside,
    )
    assert data_lost(archived, aside) == "no"


@pytest.mark.services
def test_a_writer_that_comes_during_the_s3_archive_is_refused_and_the_fresh_start_moves_both(tmp_path):
    """A job that asks for the lease while S3 is being moved aside (minutes on a big run) is refused; the fresh
    start then moves the local folder too, so the run's published steps and its folder go to the archive together
    and nothing goes on training beside them."""
    from relay.s3.store import CheckpointStore, store_for_spec

    spec_path, spec, run_dir = _prepared(tmp_path, **{"trainer.settings.save_freq": 2})
    train(spec_path, run_dir, 2)
    assert relay_cli("checkpoint", "publish", str(run_dir), spec.s3.uri).returncode == 0
    asked = []

    class StoreAJobMeetsMidArchive(CheckpointStore):
        def archive_run(self, run, name):
            took = subprocess.run(
                [PY, "-c", f"from relay.runs.lease import Lease; Lease({str(run_dir)!r}).acquire('raysubmit_late')"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT / "plugins")},
            )
            asked.append(took)
            return super().archive_run(run, name)

    plain = store_for_spec(spec)
    state = prepare_run(spec, "r", fresh_start=True, confirm="r", store=StoreAJobMeetsMidArchive(plain.client, spec.s3.uri))
    (took,) = asked
    assert took.returncode != 0 and "raysubmit_late cannot take its lease" in took.stderr, took.stderr[-2000:]
    assert state.archived_to and state.archived_uri and state.latest_step == 0
    assert plain.latest("r") is None and not layout.step_dirs(run_dir)
    aside = CheckpointStore(plain.client, f"{spec.s3.uri}/.archive")
    assert [m.step for m in aside.published(os.path.basename(state.archived_to))] == [2]
