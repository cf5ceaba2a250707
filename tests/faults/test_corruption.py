"""A run's newest checkpoint (or its tracker) corrupted in each way of the checkpoint issue, between two
chunks; the next chunk's trainer then starts. Each case: Relay's gate (relay.checkpoints.gate.admit_dir, what the
DAG's validate task calls) refuses the damage at the right check; the trainer's own validation refuses
it the same way, moves the checkpoint whole to .relay/quarantine (never deletes it), falls back to the
newest valid checkpoint and resumes there; the run finishes bitwise equal to an uninterrupted run; the
steps lost are those since the newest valid checkpoint (3 when step 9 is damaged, 0 when only the
tracker is).

A run trained to step 9 (checkpoints 3, 6, 9) is built once and copied per case. The trainers are
`relay train` children of a fork server; the baseline is one plain `relay train` process.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from relay.checkpoints.gate import admit_dir
from relay.checkpoints.resume import QUARANTINE
from relay.checkpoints.validate import validate_checkpoint
from relay.runs import layout
from relay.runs.metrics import SUPERSEDED, read_jsonl
from support.corrupt import DEFECTS, MARKER, change_world_size
from support.faults import ForkServer, assert_finished_as
from support.helpers import read_metrics, write_spec

STEPS, SAVE_FREQ, DAMAGED = 12, 3, 9

# way -> (damage(run_dir), the check that refuses it, words its detail holds, the step the refusal names:
# DAMAGED when global_step_9 is damaged; the tracker's missing step, or None, when the tracker is).
WAYS = {
    name: (lambda run, b=breaks: b(layout.step_dir(run, DAMAGED)), check, words, DAMAGED)
    for name, (breaks, check, words) in DEFECTS.items()
}
WAYS["changed world size"] = (
    lambda run: change_world_size(layout.step_dir(run, DAMAGED), 2),
    "consistency",
    "world size 2, but the run's earlier checkpoint (step 6) has world size 1",
    DAMAGED,
)
WAYS["tracker names a missing step"] = (
    lambda run: layout.tracker_path(run).write_text("10"),
    "structure",
    "does not exist",
    10,
)
WAYS["tracker holds garbage"] = (
    lambda run: layout.tracker_path(run).write_bytes(b"\x00garbage"),
    "structure",
    "not a step number",
    None,
)

# The rows: what was done to the run, and why the checkpoint was refused (each asserted through WAYS' words).
FAULT = {
    "missing optim": "checkpoint 9: actor/optim_world_size_1_rank_0.pt deleted",
    "missing extra_state": "checkpoint 9: actor/extra_state_world_size_1_rank_0.pt deleted",
    "missing data.pt": "checkpoint 9: data.pt (the dataloader state) deleted",
    "truncated shard": "checkpoint 9: actor/model_world_size_1_rank_0.pt truncated to half its size",
    "zero-byte shard": "checkpoint 9: actor/model_world_size_1_rank_0.pt emptied (0 bytes)",
    "flipped byte": "checkpoint 9: one bit flipped in the middle of actor/optim_world_size_1_rank_0.pt",
    "NaN weights": "checkpoint 9: a NaN written into model.embed_tokens.weight (the file itself whole)",
    "pickle runs code": "checkpoint 9: actor/extra_state_world_size_1_rank_0.pt replaced by a pickle that would "
    "run code (write a file)",
    "changed world size": "checkpoint 9: resharded on disk, its shards renamed to world size 2 (ranks 0 and 1) "
    "and fsdp_config.json saying 2, in a run trained at world size 1",
    "tracker names a missing step": "the tracker names step 10, whose folder does not exist (checkpoints 3, 6, 9 whole)",
    "tracker holds garbage": "the tracker holds garbage (b'\\x00garbage'; checkpoints 3, 6, 9 whole)",
}
WHY = {
    "missing optim": "global_step_9 is missing actor/optim_world_size_1_rank_0.pt",
    "missing extra_state": "global_step_9 is missing actor/extra_state_world_size_1_rank_0.pt",
    "missing data.pt": "global_step_9 is missing data.pt",
    "truncated shard": "the model shard is not a complete zip file: truncated",
    "zero-byte shard": "the model shard is empty",
    "flipped byte": "an entry of the optim shard fails its zip CRC32 check",
    "NaN weights": "model.embed_tokens.weight holds NaN",
    "pickle runs code": "loading extra_state needs exec, which could run code; nothing in it was executed",
    "changed world size": "world size 2, while the run's step 6 has world size 1: resuming would re-shard or fail",
}


def action(way: str, check: str, resumed: int) -> str:
    if way == "tracker names a missing step":
        return (
            "the resume's validation found no global_step_10 (structure check), re-pointed the tracker at the "
            f"newest valid checkpoint, step {resumed}, and resumed there; the gate refuses the tracker at the "
            "same check, moving nothing"
        )
    if way == "tracker holds garbage":
        return (
            "the resume's validation refused the tracker (structure check: not a step number), moved it to "
            f".relay/quarantine, pointed a new one at the newest valid checkpoint, step {resumed}, and resumed "
            "there; the gate refuses it at the same check, moving nothing"
        )
    return (
        f"the resume's validation refused it at the {check} check ({WHY[way]}), moved it whole to "
        f".relay/quarantine with its check report, re-pointed the tracker at step {resumed} and resumed there; "
        "the gate refuses it at the same check"
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory, uninterrupted):
    folder = tmp_path_factory.mktemp("corruption")
    spec = write_spec(folder, **{"trainer.settings.save_freq": SAVE_FREQ})
    server = ForkServer()
    try:
        nine = folder / "nine"
        log = folder / "nine.log"
        rc = server.run(["train", str(spec), "--to-step", str(DAMAGED), "--checkpoint-dir", str(nine), "--offline"], log)
        assert rc == 0, log.read_text()[-3000:]
        assert sorted(layout.step_dirs(nine)) == [3, 6, 9] and layout.read_tracker(nine) == DAMAGED
        yield {"spec": spec, "folder": folder, "server": server, "nine": nine, "baseline": uninterrupted}
    finally:
        server.close()


def digest(folder: Path) -> dict[str, str]:
    """Every file under `folder`, by relative path, with its sha256: to show a folder moved whole."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("way", list(WAYS))
def test_a_corrupted_checkpoint_is_refused_quarantined_and_the_run_resumes_bitwise(world, way, fault_row):
    damage, check, words, named = WAYS[way]
    on_tracker = named != DAMAGED  # the checkpoints are whole, the tracker is what is wrong
    case = world["folder"] / re.sub(r"[^a-z0-9]+", "-", way.lower())
    run = case / "run"
    shutil.copytree(world["nine"], run)
    damage(run)
    damaged = digest(layout.step_dir(run, DAMAGED))
    tracker_bytes = layout.tracker_path(run).read_bytes()
    last_valid = DAMAGED if on_tracker else DAMAGED - SAVE_FREQ
    reached = max(r["step"] for r in read_metrics(run))  # steps trained before the fault
    assert reached == DAMAGED

    # The gate (the DAG's validate task, `relay checkpoint validate --quarantine`, publish), on a copy.
    gated = case / "gate" / "run"
    shutil.copytree(run, gated)
    admission = admit_dir(gated)
    assert not admission.ok and admission.report.failed.name == check, admission.explain()
    assert words in admission.report.failed.detail, admission.explain()
    if on_tracker:  # nothing to move
        assert admission.quarantined_to is None and digest(layout.step_dir(gated, DAMAGED)) == damaged
    else:
        assert Path(admission.quarantined_to).parent == layout.relay_dir(gated, QUARANTINE)
        assert digest(Path(admission.quarantined_to)) == damaged, "quarantined whole"
        assert admission.fell_back_to == last_valid and layout.read_tracker(gated) == last_valid

    # The next chunk's trainer.
    log = case / "resumed.log"
    rc = world["server"].run(
        ["train", str(world["spec"]), "--to-step", str(STEPS), "--checkpoint-dir", str(run), "--offline"], log
    )
    out = log.read_text()
    assert rc == 0, out[-3000:]
    refused = re.search(r"\[relay\] (?:quarantined checkpoint step (\S+)|refused the tracker): (\w+) failed: (.*)", out)
    assert refused and (refused.group(1), refused.group(2)) == (None if on_tracker else str(named), check), out[-3000:]
    assert words in refused.group(3), out[-3000:]
    resumed = int(re.search(r"resumes from step (\d+)", out).group(1))
    assert resumed == last_valid, out[-3000:]
    quarantine = layout.relay_dir(run, QUARANTINE)
    moved = [p for p in quarantine.glob(f"global_step_{DAMAGED}.*") if p.is_dir()]
    if on_tracker:
        assert not moved, "global_step_9 is whole: resumed from, not quarantined"
        set_aside = [p.read_bytes() for p in quarantine.glob(f"{layout.TRACKER}.*")]
        assert set_aside == ([tracker_bytes] if named is None else []), "a garbage tracker is set aside, not deleted"
    else:
        assert len(moved) == 1 and digest(moved[0]) == damaged, "the damaged checkpoint was moved whole"
        report = json.loads(Path(f"{moved[0]}.report.json").read_text())
        assert not report["ok"] and [c["name"] for c in report["checks"] if not c["ok"]] == [check]
        superseded = [r["step"] for r in read_jsonl(run / SUPERSEDED)]
        assert superseded == list(range(last_valid + 1, DAMAGED + 1)), "their first rows are kept aside"
    assert not list(case.rglob(MARKER)), "the pickle's code ran"

    # The run finished, bitwise the uninterrupted run, losing only the steps since the last valid checkpoint.
    lost = reached - resumed
    assert lost == reached - last_valid
    assert_finished_as(run, world["baseline"], STEPS)
    # No data lost: every checkpoint left in the run folder is valid.
    for s in layout.step_dirs(run):
        report = validate_checkpoint(run, s)
        assert report.ok, report.summary()
    fault_row(
        case="corruption",
        fault=FAULT[way],
        action=action(way, check, resumed),
        steps_lost=lost,
        layer="trainer",
        run_dir=run,
    )


def test_the_gates_fallback_never_moves_the_tracker_back_over_a_newer_commit(tmp_path):
    """The gate quarantines a corrupt step 4 and validates step 2 to fall back to (outside the run's lock, it takes
    time); meanwhile a trainer (the live job of a supervised run) commits step 6. The gate's tracker move is a
    compare-and-swap under the lock: it finds the tracker moved on and leaves it at 6, which is never lost."""
    from relay.common.faultpoint import FAULT_ENV
    from support.corrupt import flip
    from support.faults import ForkServer, wait_for_line
    from support.helpers import relay_cli, write_spec

    spec = write_spec(tmp_path, name="cas", **{"trainer.settings.save_freq": 2})
    rd = tmp_path / "ckpt" / "cas"
    assert relay_cli("train", str(spec), "--to-step", "4", "--offline").returncode == 0
    flip(rd / "global_step_4" / "actor" / layout.shard_name("model", 1, 0))
    server = ForkServer()
    try:
        log, once = tmp_path / "gate.log", tmp_path / "gate.once"
        gate = server.start(
            ["checkpoint", "validate", str(rd), "--step", "4", "--quarantine"],
            log,
            env={FAULT_ENV: "before_fallback@2", "RELAY_FAULT_ONCE": str(once)},
        )
        wait_for_line(log, "[relay-fault] paused at before_fallback step 2", gate)
        # The live trainer falls back by itself, trains steps 3..6 and commits step 6.
        r = relay_cli("train", str(spec), "--to-step", "6", "--offline")
        assert r.returncode == 0 and layout.read_tracker(rd) == 6, r.stderr[-2000:]
        once.with_name(once.name + ".go").touch()
        assert server.wait(gate) == 1, log.read_text()[-3000:]  # the finding: step 4 is corrupt
    finally:
        server.close()
    assert layout.read_tracker(rd) == 6, "the gate moved the tracker back over a newer commit"
    assert "tracker moved to step 6" in log.read_text(), log.read_text()[-3000:]
    assert sorted(layout.step_dirs(rd)) == [2, 4, 6], "the retrained step 4 and step 6, committed"
