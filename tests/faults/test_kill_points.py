"""The trainer SIGKILLed at 20 seeded points, some inside a checkpoint's write, resumed from each, against
one uninterrupted baseline. Each case: the run finishes, its final weights are bitwise those of the
baseline, and the steps lost are at most the steps since the last committed (valid) checkpoint.

The kill lands exactly where it is meant to: the trainer's fault hook (relay.common.faultpoint.fault_point,
RELAY_FAULT_PAUSE_AT=<phase>@<step>) prints a marker and sleeps there, and the test SIGKILLs it then.
Points are drawn from every (phase, step) of a 12-step run saving every 3 steps, with RELAY_TEST_SEED
(default: the checked-out commit, so each CI run of a new commit tries other points);
RELAY_KILL_POINTS=before_rename@6,after_step@4 names the points instead (to replay one).

The trainers are `relay train` (relay.cli.main) children of a fork server that has imported torch and
verl once; the baseline is a plain `relay train` process, so a forked child is held to the same bits.
"""

from __future__ import annotations

import os
import random
import re
import subprocess

import pytest

from relay.common.faultpoint import FAULT_ENV, FAULT_PHASES
from relay.runs import layout
from support.faults import ForkServer, assert_finished_as, kill, wait_for_line
from support.helpers import ROOT, read_metrics, write_spec

STEPS, SAVE_FREQ, POINTS_PER_RUN, INSIDE_CHECKPOINT = 12, 3, 20, 12


def seed() -> int:
    if os.environ.get("RELAY_TEST_SEED"):
        return int(os.environ["RELAY_TEST_SEED"])
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return int(head[:8], 16)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def kill_points(rng_seed: int) -> list[tuple[str, int]]:
    """POINTS_PER_RUN (phase, step) points: INSIDE_CHECKPOINT of them inside a checkpoint's write."""
    if named := os.environ.get("RELAY_KILL_POINTS"):
        return [(p, int(s)) for p, _, s in (x.strip().partition("@") for x in named.split(",") if x.strip())]
    saves = range(SAVE_FREQ, STEPS + 1, SAVE_FREQ)
    inside = [(phase, s) for s in saves for phase in FAULT_PHASES if phase != "after_step"]
    between = [("after_step", s) for s in range(1, STEPS + 1)]
    rng = random.Random(rng_seed)
    chosen = rng.sample(inside, INSIDE_CHECKPOINT) + rng.sample(between, POINTS_PER_RUN - INSIDE_CHECKPOINT)
    return sorted(chosen, key=lambda p: (p[1], FAULT_PHASES.index(p[0])))


SEED = seed()
POINTS = kill_points(SEED)

WHERE = {
    "after_step": "after step {s}'s row, before its checkpoint",
    "mid_save": "inside checkpoint {s}'s save (actor shards written, data.pt not yet)",
    "before_fsync": "after checkpoint {s} was written to staging, before its fsync",
    "before_rename": "holding the lease lock, checkpoint {s} durable in staging, before its rename",
    "after_rename": "after global_step_{s} was renamed into place, before the tracker named it",
    "after_tracker": "right after the tracker named checkpoint {s}",
}


def action(phase: str, step: int, resumed: int) -> str:
    frm = f"resumed from step {resumed}" if resumed else "started again from step 0 (no checkpoint was committed)"
    if phase == "after_step":
        return f"{frm}; the steps after it were trained again, their first rows kept in metrics.superseded.jsonl"
    if phase in ("mid_save", "before_fsync", "before_rename"):
        return (
            f"the half-written checkpoint {step} stayed in .relay/staging, never renamed nor named by the "
            f"tracker; {frm}; the next attempt removed the stale staging"
        )
    if phase == "after_rename" and resumed == step:
        return (
            f"no tracker existed yet: global_step_{step}, whole (fsynced before its rename), passed validation and was {frm}"
        )
    if phase == "after_rename":
        return (
            f"global_step_{step} was never named by the tracker, so never resumed from; {frm}; "
            f"the retrained step {step} set the old folder aside in .relay/superseded"
        )
    return f"checkpoint {step} was committed: {frm}, nothing trained again"


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, uninterrupted):
    folder = tmp_path_factory.mktemp("kills")
    spec = write_spec(folder, **{"trainer.settings.save_freq": SAVE_FREQ})
    (folder / "ckpt").mkdir()
    server = ForkServer()
    yield {"spec": spec, "folder": folder, "server": server, "baseline": uninterrupted}
    server.close()


@pytest.mark.parametrize("point", POINTS, ids=[f"{p}@{s}" for p, s in POINTS])
def test_a_trainer_killed_here_resumes_and_ends_bitwise_equal(matrix, point, fault_row):
    from relay.checkpoints.validate import validate_checkpoint

    phase, step = point
    server = matrix["server"]
    run_dir = matrix["folder"] / "ckpt" / f"kill-{phase}-{step}"
    argv = ["train", str(matrix["spec"]), "--to-step", str(STEPS), "--checkpoint-dir", str(run_dir), "--offline"]

    killed_log = run_dir.parent / f"{run_dir.name}.killed.log"
    pid = server.start(argv, killed_log, {FAULT_ENV: f"{phase}@{step}"})
    wait_for_line(killed_log, f"[relay-fault] paused at {phase} step {step}", pid)
    kill(pid)
    assert server.wait(pid) == -9
    reached = max(r["step"] for r in read_metrics(run_dir))  # steps trained before the kill
    committed = layout.read_tracker(run_dir) or 0  # the last checkpoint the kill left committed

    resumed_log = run_dir.parent / f"{run_dir.name}.resumed.log"
    rc = server.run(argv, resumed_log)
    out = resumed_log.read_text()
    assert rc == 0, out[-3000:]
    m = re.search(r"resumes from (?:step (\d+)|scratch)|already reached step (\d+)", out)
    assert m, out[-3000:]
    resumed = int(m.group(1) or m.group(2) or 0)
    if m.group(1):  # a resume from a checkpoint: its certificate held, exactly (relay.checkpoints.certificate)
        assert f"certified resume from step {resumed}: probe log-probs differ by at most 0 (exact)" in out, out[-3000:]

    # Steps lost: at most those since the last committed checkpoint. Relay never resumes from an older one;
    # it may resume from a newer one when that is whole (renamed into place after its fsync, before a
    # first tracker existed) and passes validation.
    assert committed <= resumed <= reached, f"resumed from {resumed}; committed {committed}, reached {reached}"
    lost = reached - resumed
    assert 0 <= lost <= reached - committed
    # The run finished, and is bitwise the uninterrupted run.
    assert_finished_as(run_dir, matrix["baseline"], STEPS)
    # No data lost: every checkpoint left in the run folder is whole.
    for s in layout.step_dirs(run_dir):
        report = validate_checkpoint(run_dir, s, upto="integrity")
        assert report.ok, report.summary()
    fault_row(
        case="trainer-kill",
        fault=f"trainer SIGKILLed {WHERE[phase].format(s=step)}",
        action=action(phase, step, resumed),
        steps_lost=lost,
        test_seed=SEED,
        run_dir=run_dir,
        driver=(-9, killed_log.read_text(errors="replace")),
    )
