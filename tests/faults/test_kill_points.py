"""The trainer SIGKILLed at seeded points, some inside a checkpoint's write, resumed from each, against one
uninterrupted baseline. Each case: the run finishes, its final weights are bitwise those of the baseline, and the
steps lost are at most the steps since the last committed (valid) checkpoint.

The kill lands exactly where it is meant to: the trainer's fault hook (relay.common.faultpoint.fault_point,
RELAY_FAULT_PAUSE_AT=<phase>@<step>) prints a marker and sleeps there, and the test SIGKILLs it then.

The matrix (tests/support/kill_matrix.py): every (phase, step) of a 12-step run in two chunks of 6, saving every 3
steps, under both handoffs: cold (`relay train` to step 12, as a chunk's new job trains) and warm (chunk 1's job,
the Ray job's entrypoint, going on into chunk 2 once the test, playing chunk 2's train task, admits it; a case of
steps 7 to 12 lands in that warm chunk). CI tries a seeded sample, one case of every phase, both handoffs among
them (RELAY_TEST_SEED, default the checked-out commit); the faults lane (`./scripts/test.sh --faults`) tries them
all; RELAY_KILL_POINTS=before_rename@6,after_step@9-warm names cases to replay.

The killed trainers and their resumes are children of a fork server that has imported torch and verl once
(`relay train`, or the chunk's Ray job entrypoint `python -m relay.trainers.job`); the baseline is a plain
`relay train` process, so a forked child is held to the same bits.
"""

from __future__ import annotations

import os
import re
import time

import pytest

from relay.common.faultpoint import FAULT_ENV
from relay.runs import layout
from support.faults import ForkServer, alive, assert_finished_as, kill, wait_for_line
from support.helpers import read_metrics, write_spec
from support.kill_matrix import CHUNK, SAVE_FREQ, STEPS, WARM, case_id, chosen, seed

WHOLE = os.environ.get("RELAY_TEST_LANE") == "faults"  # the faults lane runs the whole matrix (tests/conftest.py)
SEED = seed()
POINTS = chosen(WHOLE, SEED)

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
    # Warm chunks for the chunk's job; `relay train` never goes on into a chunk nothing admits, whatever the spec says.
    spec = write_spec(folder, **{"trainer.settings.save_freq": SAVE_FREQ, "chunks.handoff": "warm"})
    (folder / "ckpt").mkdir()
    server = ForkServer()
    yield {"spec": spec, "folder": folder, "server": server, "baseline": uninterrupted}
    server.close()


def killed_in_its_warm_chunk(server: ForkServer, spec_path, run_dir, phase: str, step: int, log) -> None:
    """Chunk 1's job (the Ray job's entrypoint, with warm handoffs) trains steps 1 to 6, goes on warm into chunk 2 and
    is admitted there as chunk 2's train task admits it; SIGKILLed at the fault point of `step` in that chunk."""
    from relay.runs import handoff
    from relay.runs.metrics import read_events
    from relay.runs.run import Run
    from relay.spec.run_spec import load_spec
    from relay.trainers.contract import ENV_VAR, ChunkRequest

    spec = load_spec(spec_path, check_environment=False)
    req = ChunkRequest(run=Run.of(spec, run_dir.name), to_step=CHUNK, chunk=1, attempt=f"job-{run_dir.name}", handoff=True)
    assert req.run_dir == run_dir
    pid = server.start(["-m", "relay.trainers.job"], log, {ENV_VAR: req.to_json(), FAULT_ENV: f"{phase}@{step}"})
    marker, admitted, deadline = f"[relay-fault] paused at {phase} step {step}", False, time.time() + 300
    while not (log.exists() and marker in log.read_text(errors="replace")):
        assert time.time() < deadline, f"no {marker!r} within 300 s"
        if not admitted and (record := handoff.warm(run_dir, 2)) is not None:
            handoff.admit(run_dir, 2, attempt=record["attempt"], token=record["token"], by="the test's chunk 2 task")
            admitted = True
        assert alive(pid), f"the job ended before {marker!r}:\n{log.read_text(errors='replace')[-3000:]}"
        time.sleep(0.02)
    kill(pid)
    assert server.wait(pid) == -9
    starts = [(e["chunk"], e["resumed_from"], e["warm"]) for e in read_events(run_dir) if e["event"] == "chunk_start"]
    assert admitted and starts == [(1, 0, False), (2, CHUNK, True)], f"the kill landed outside the warm chunk: {starts}"


@pytest.mark.parametrize("point", POINTS, ids=[case_id(p) for p in POINTS])
def test_a_trainer_killed_here_resumes_and_ends_bitwise_equal(matrix, point, fault_row):
    from relay.checkpoints.validate import validate_checkpoint

    phase, step, warm = point
    server = matrix["server"]
    run_dir = matrix["folder"] / "ckpt" / f"kill-{phase}-{step}{WARM if warm else ''}"
    argv = ["train", str(matrix["spec"]), "--to-step", str(STEPS), "--checkpoint-dir", str(run_dir), "--offline"]

    killed_log = run_dir.parent / f"{run_dir.name}.killed.log"
    if warm:
        killed_in_its_warm_chunk(server, matrix["spec"], run_dir, phase, step, killed_log)
    else:
        pid = server.start(argv, killed_log, {FAULT_ENV: f"{phase}@{step}"})
        wait_for_line(killed_log, f"[relay-fault] paused at {phase} step {step}", pid)
        kill(pid)
        assert server.wait(pid) == -9
    reached = max(r["step"] for r in read_metrics(run_dir))  # steps trained before the kill
    committed = layout.read_tracker(run_dir) or 0  # the last checkpoint the kill left committed

    # The resume: `relay train`, as a new cold job of the chunk would (Airflow's retry of a warm chunk is one).
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
        case="warm-chunk-kill" if warm else "trainer-kill",
        fault=f"trainer SIGKILLed {WHERE[phase].format(s=step)}"
        + (", in chunk 2, which chunk 1's job went on into warm" if warm else ""),
        action=action(phase, step, resumed) + ("; the retry was a new, cold job" if warm else ""),
        steps_lost=lost,
        **({} if os.environ.get("RELAY_KILL_POINTS") or WHOLE else {"test_seed": SEED}),
        run_dir=run_dir,
        driver=(-9, killed_log.read_text(errors="replace")),
    )
