"""The training data changed in each way of the data issue between chunk 1 and chunk 2 of a run whose
data was frozen at chunk 1. verl resumes its dataloader at an offset into the parquet, so a changed source
would silently feed other samples. Each case: the checks before chunk 2 (relay.preflight.checks.before_chunk,
what the DAG's train task runs before submitting the chunk's job) refuse it, naming what changed, and leave
the run folder untouched; after the user's fix (the source restored, or data.on_source_change: use_frozen)
chunk 2 resumes from step 6 on the frozen bytes and the run ends bitwise equal to an uninterrupted run on
the original data, no step lost.

Each case makes its own interrupted run (as tests/conftest.py's `interrupted` fixture does: data frozen,
trained to step 6 of 12, its own source file), so the cases share nothing but the baseline. The trainers
are `relay train` children of a fork server; the baseline is one plain `relay train` process.
"""

from __future__ import annotations

import hashlib
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from relay.checkpoints.validate import validate_checkpoint
from relay.data.fingerprint import sha256_file
from relay.data.freeze import SourceDriftError
from relay.preflight.checks import before_chunk, prepare_data
from relay.preflight.prepare import prepare_run
from relay.runs import layout
from relay.runs.metrics import SUPERSEDED
from relay.runs.record import read_record
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from support.faults import ForkServer, assert_finished_as
from support.helpers import ROOT, write_spec

STEPS, CHUNK_END, SAVE_FREQ = 12, 6, 3
DATA = ROOT / "include" / "data" / "arith_train.parquet"
SETTINGS = {"data.val_files": [], "trainer.settings.save_freq": SAVE_FREQ}


def _rewrite(path, change) -> None:
    rows = pq.read_table(path).to_pylist()
    pq.write_table(pa.Table.from_pylist(change(rows)), path)


def _set(i: int, column: str, **fields):
    """A change of row i: some fields of its struct column set."""
    return lambda rows: [dict(r, **{column: {**r[column], **fields}}) if n == i else r for n, r in enumerate(rows)]


def _rename_column(path) -> None:
    table = pq.read_table(path)
    pq.write_table(table.rename_columns(["reward" if c == "reward_model" else c for c in table.column_names]), path)


# way -> (change(source path), what before_chunk's refusal names, the user's fix)
WAYS = {
    "row appended": (
        lambda p: _rewrite(p, lambda r: [*r, {**r[0], "extra_info": {"split": "train", "index": 1000}}]),
        ["rows 1000 -> 1001", "1 row(s) added (extra_info.index: 1000)"],
        "use_frozen",
    ),
    "row deleted": (
        lambda p: _rewrite(p, lambda r: r[:10] + r[11:]),
        ["rows 1000 -> 999", "1 row(s) removed (extra_info.index: 10)"],
        "restore",
    ),
    "rows reordered": (
        lambda p: _rewrite(p, lambda r: r[1:] + r[:1]),
        ["rows reordered (same rows, another order): the dataloader offset would point at other samples"],
        "use_frozen",
    ),
    "null reward_model.ground_truth": (
        lambda p: _rewrite(p, _set(3, "reward_model", ground_truth=None)),
        ["1 row(s) changed (extra_info.index: 3)"],
        "restore",
    ),
    "duplicated extra_info.index": (
        lambda p: _rewrite(p, _set(5, "extra_info", index=4)),
        ["rows 1000 -> 1000", "1 row(s) changed (row: 5)"],
        "use_frozen",
    ),
    "column renamed": (
        _rename_column,
        [
            "schema: - reward_model: struct<style: string, ground_truth: string>",
            "schema: + reward: struct<style: string, ground_truth: string>",
        ],
        "restore",
    ),
}
# A changed row that breaks the data-quality suite: the refusal says which expectation fails, too.
QUALITY = {
    "null reward_model.ground_truth": "✘ expect_column_values_to_not_be_null on reward_model.ground_truth: 1 rows",
    "duplicated extra_info.index": "✘ expect_column_values_to_be_unique on extra_info.index: 2 rows",
}
FAULT = {
    "row appended": "had a row appended",
    "row deleted": "had a row deleted",
    "rows reordered": "had its rows reordered (the first row moved last)",
    "null reward_model.ground_truth": "had one row's reward_model.ground_truth set to null",
    "duplicated extra_info.index": "had one row's extra_info.index set to another row's (duplicated)",
    "column renamed": "had its reward_model column renamed to reward",
}
FIXED = {  # what the user did, and what followed
    "restore": "the user restored the source's bytes: the check passed and chunk 2 resumed from step {resumed} "
    "on the frozen bytes",
    "use_frozen": "the user set data.on_source_change: use_frozen: the check passed, returning the change as a "
    "warning, and chunk 2 resumed from step {resumed} on the frozen bytes, the source still changed",
}


@pytest.fixture(scope="module")
def world(tmp_path_factory, uninterrupted):
    folder = tmp_path_factory.mktemp("datachange")
    server = ForkServer()
    try:  # the baseline: the test spec's run on the original data (include/data), uninterrupted
        yield {"folder": folder, "server": server, "baseline": uninterrupted}
    finally:
        server.close()


def interrupted_run(world, name: str):
    """Run "r" of its own spec and source (a copy of the demo data): data frozen and settings recorded at
    chunk 1, as the DAG's data task does, then trained to step 6 of 12 and stopped there."""
    base = world["folder"] / name
    base.mkdir()
    source = base / "source.parquet"
    shutil.copyfile(DATA, source)
    spec_path = write_spec(base, **{"data.train_files": [str(source)], **SETTINGS})
    spec = load_spec(spec_path)
    prepare_run(spec, "r")
    prepare_data(Run.of(spec, "r"))
    log = base / "chunk-1.log"
    rc = world["server"].run(["train", str(spec_path), "--to-step", str(CHUNK_END), "--run", "r", "--offline"], log)
    assert rc == 0, log.read_text()[-3000:]
    return spec_path, spec, source


def digest(folder) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("way", list(WAYS))
def test_a_source_changed_between_chunks_is_refused_and_the_run_ends_bitwise(world, way, fault_row):
    change, named, fix = WAYS[way]
    spec_path, spec, source = interrupted_run(world, re.sub(r"[^a-z0-9]+", "-", way.lower()))
    run_dir = spec.run_dir("r")
    frozen_sha = sha256_file(DATA)[0]
    assert [(f["sha256"], f["rows"]) for f in read_record(run_dir)["data"]["files"]] == [(frozen_sha, 1000)]
    before = digest(run_dir)
    original = source.read_bytes()
    change(source)
    assert sha256_file(source)[0] != frozen_sha

    # Before chunk 2's job (default policy, on_source_change: fail): refused, naming what changed.
    with pytest.raises(SourceDriftError) as refused:
        before_chunk(Run.of(spec, "r"))
    message = str(refused.value)
    assert message.startswith("the training data changed under run r:\ntrain source changed since the freeze:")
    assert all(line in message for line in named), message
    if way in QUALITY:
        assert "the changed source also fails the data-quality suite:" in message and QUALITY[way] in message, message
    assert "What to do: restore the source files, or set data.on_source_change: use_frozen" in message
    # Nothing in the run folder changed: tracker at 6, checkpoints 3 and 6 whole, no record or event written.
    assert digest(run_dir) == before
    assert layout.read_tracker(run_dir) == CHUNK_END and sorted(layout.step_dirs(run_dir)) == [3, 6]

    # The user's fix, then the same check again.
    if fix == "restore":
        source.write_bytes(original)
        assert before_chunk(Run.of(spec, "r"))["source_changes"] == []
    else:
        d = yaml.safe_load(spec_path.read_text())
        d["data"]["on_source_change"] = "use_frozen"
        spec_path.write_text(yaml.safe_dump(d, sort_keys=False))
        spec = load_spec(spec_path)
        (warning,) = before_chunk(Run.of(spec, "r"))["source_changes"]
        assert all(line in warning for line in named), warning
    assert digest(run_dir) == before

    # Chunk 2, as the user runs it.
    log = spec_path.parent / "chunk-2.log"
    rc = world["server"].run(["train", str(spec_path), "--to-step", str(STEPS), "--run", "r", "--offline"], log)
    out = log.read_text()
    assert rc == 0, out[-3000:]
    assert f"training on frozen data: train {frozen_sha[:12]} (1000 rows)" in out, out[-3000:]
    assert (sha256_file(source)[0] == frozen_sha) == (fix == "restore"), "use_frozen leaves the source changed"
    resumed = int(re.search(r"resumes from step (\d+)", out).group(1))
    lost = CHUNK_END - resumed  # steps trained in chunk 1 and trained again
    assert lost == 0 and not (run_dir / SUPERSEDED).exists()
    assert_finished_as(run_dir, world["baseline"], STEPS)
    for s in layout.step_dirs(run_dir):  # no data lost: every checkpoint left is valid
        report = validate_checkpoint(run_dir, s)
        assert report.ok, report.summary()

    fault_row(
        case="data-change",
        fault=f"the source {FAULT[way]} between chunk 1 and chunk 2",
        action=f"refused chunk 2 before its job with 'the training data changed under run r: … "
        f"{'; '.join(named + ([QUALITY[way].lstrip('✘ ')] if way in QUALITY else []))}' and what to "
        "do (on_source_change: fail), the run folder untouched; " + FIXED[fix].format(resumed=resumed),
        steps_lost=lost,
        layer="trainer + preflight",
        run_dir=run_dir,
    )
