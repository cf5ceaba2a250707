"""Attacks on the names and paths Relay builds from what it is given or reads back: run names (the
Airflow Param, the CLI's --run), S3 URIs and keys, a manifest's file list, latest.json, the tracker,
the run record's frozen data. None may reach outside the run folder, the checkpoint root or the
run's S3 prefix; each is refused with an error that names the bad value and says what to do."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from relay.checkpoints import manifest
from relay.common import files
from relay.common.errors import CheckpointError, RelayError, SpecError
from relay.runs import layout
from relay.runs.folder import RunFolder
from relay.spec.run_spec import load_spec, spec_from_dict
from support.helpers import DEMO_SPEC, relay_cli, write_spec

BAD_RUN_NAMES = [
    "../escape",
    "..",
    ".",
    "a/b",
    "/abs",
    "a\\b",
    "run\n",
    "run\x00",
    "a..b",
    "",
    " run",
    ".hidden",
    "x" * 200,
    "%2e%2e",
    "run/../../x",
    "ü-run",
]


@pytest.fixture(scope="module")
def spec():
    return load_spec(DEMO_SPEC, check_environment=False)


@pytest.mark.parametrize("name", BAD_RUN_NAMES, ids=repr)
def test_a_run_name_cannot_leave_the_checkpoint_root(spec, name):
    from relay.preflight.prepare import resolve_run_name

    with pytest.raises(SpecError) as e:
        spec.run_dir(name)
    assert repr(name) in str(e.value) and "What to do: use letters, digits" in str(e.value)
    if name.strip() == name and name:  # the DAG's `run` Param goes through this (stripped; empty: the spec's)
        with pytest.raises(SpecError):
            resolve_run_name(spec, name)


def test_a_refused_run_name_creates_nothing(tmp_path):
    from relay.preflight.prepare import prepare_run

    spec = load_spec(write_spec(tmp_path), check_environment=False)
    with pytest.raises(SpecError):
        prepare_run(spec, "../outside")
    assert not (tmp_path / "outside").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["train", "{spec}", "--to-step", "1", "--run", "../outside"],
        ["plan", "{spec}", "--run", "a/b"],
        ["checkpoint", "restore", "{uri}", "{tmp}/restore", "--run", "../other-run"],
        ["checkpoint", "ls", "{uri}", "--run", "../../other-prefix"],
        ["checkpoint", "inspect", "s3://relay/runs/../x/global_step_1"],
        ["report", "s3://relay/runs/.."],
        ["checkpoint", "restore", "s3://relay/a//b", "{tmp}/restore"],
    ],
    ids=lambda a: " ".join(a[:2]) + " " + a[-1],
)
def test_the_cli_refuses_names_that_escape(tmp_path, args):
    spec_path = write_spec(tmp_path)
    uri = load_spec(spec_path, check_environment=False).s3.uri
    argv = [a.format(spec=spec_path, uri=uri, tmp=tmp_path) for a in args]
    r = relay_cli(*argv, timeout=120)
    assert r.returncode in (1, 2), r.stdout + r.stderr
    assert r.stderr.startswith("relay: ") and "What to do:" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "outside").exists() and not (tmp_path.parent / "outside").exists()


@pytest.mark.parametrize(
    "uri",
    [
        "s3://relay/a/../b",
        "s3://relay/./a",
        "s3://relay/a//b",
        "s3://Relay/x",
        "s3://relay/runs\n",
        "s3://relay/a/..",
        "http://relay/runs",
    ],
)
def test_a_spec_s3_uri_with_dot_segments_is_refused(uri):
    from support.helpers import spec_dict

    with pytest.raises(SpecError) as e:
        spec_from_dict(spec_dict(**{"s3.uri": uri}), check_environment=False)
    assert e.value.key == "s3.uri"


def test_store_keys_never_leave_the_run_prefix():
    from relay.common.errors import StoreError
    from relay.s3.store import CheckpointStore, parse_uri

    store = CheckpointStore(client=None, uri="s3://relay/runs")
    assert (
        store.step_key("r1", 6, "actor/model_world_size_1_rank_0.pt")
        == "runs/r1/global_step_6/actor/model_world_size_1_rank_0.pt"
    )
    for run in ("../r2", "r1/../r2", "", "r1\n"):
        with pytest.raises(SpecError):
            store.run_key(run)
    for rel in ("../../r2/latest.json", "/etc/passwd", "a//b", "a/./b", "a\\b", "x\x00"):
        with pytest.raises(StoreError) as e:
            store.step_key("r1", 6, rel)
        assert repr(rel) in str(e.value)
    for step in (-1, True, "6/../7", 1.5):
        with pytest.raises(StoreError):
            store.step_key("r1", step)
    for uri in ("s3://relay/runs/../other", "s3://relay/runs/./x", "s3://relay/a//x", "s3://a/x", "relay/x"):
        with pytest.raises(StoreError):
            parse_uri(uri)


def _manifest(files: dict) -> str:
    return manifest.Manifest(run="r", step=5, world_size=1, fsdp_version=2, files=files, params={}).to_json()


@pytest.mark.parametrize(
    "rel", ["../../etc/x", "/etc/passwd", "actor/../../../x", "a//b", "./a", "a\\..\\b", "a/\x00b", "", "x" * 2000]
)
def test_a_manifest_naming_a_path_outside_its_checkpoint_is_refused(rel):
    with pytest.raises(CheckpointError) as e:
        manifest.Manifest.from_json(_manifest({rel: {"size": 1, "crc64nvme": "AAAAAAAAAAA="}}), "m.json")
    assert "m.json is malformed" in e.value.what and "What to do" in str(e.value)


@pytest.mark.services
def test_a_published_manifest_listing_dot_dot_is_never_restored(s3_server, tmp_path):
    """An attacker with write access to the bucket plants a manifest whose files reach outside the run."""
    from relay.s3.restore import restore
    from relay.s3.store import CheckpointStore, s3_client

    store = CheckpointStore(s3_client(), f"s3://relay/test-{uuid.uuid4().hex[:12]}")
    evil = _manifest({"../../../../escaped.txt": {"size": 5, "crc64nvme": "AAAAAAAAAAA="}})
    store.client.put_object(Bucket="relay", Key=store.step_key("r", 5, manifest.NAME), Body=evil.encode())
    store.client.put_object(Bucket="relay", Key=f"{store.prefix}/r/global_step_5/escaped.txt", Body=b"owned")
    logs: list[str] = []
    run_dir = tmp_path / "a" / "b" / "c" / "r"
    assert restore(store, RunFolder("r", run_dir), log=logs.append) is None
    assert any("skipping" in m and "../../../../escaped.txt" in m for m in logs), logs
    assert not list(tmp_path.rglob("escaped.txt"))
    # A manifest that names another step than its key's is refused too (copied from elsewhere).
    other = manifest.Manifest(run="r", step=7, world_size=1, fsdp_version=2, files={}, params={}).to_json()
    store.client.put_object(Bucket="relay", Key=store.step_key("r", 5, manifest.NAME), Body=other.encode())
    with pytest.raises(CheckpointError, match="names step 7, not 5"):
        store.manifest("r", 5)


@pytest.mark.parametrize(
    "latest",
    [
        b'{"step": "1/../../other/global_step_5"}',
        b'{"step": -3}',
        b"[1]",
        b'{"step": true}',
        b"\xff\xfe garbage",
        b'{"uri": "s3://x"}',
    ],
)
@pytest.mark.services
def test_a_malformed_latest_json_is_refused_by_name(s3_server, latest):
    from relay.common.errors import StoreError
    from relay.s3.store import CheckpointStore, s3_client

    store = CheckpointStore(s3_client(), f"s3://relay/test-{uuid.uuid4().hex[:12]}")
    store.client.put_object(Bucket="relay", Key=store.run_key("r", "latest.json"), Body=latest)
    with pytest.raises(StoreError) as e:
        store.latest("r")
    assert "latest.json" in e.value.what and e.value.fix


@pytest.mark.parametrize(
    "content", [b"../../etc/passwd", b"6/../9", b"\xc2\xb2", "١٢".encode(), b"9" * 5000, b"-1", b"1e3", b"0x10", b""]
)
def test_a_tracker_that_is_not_a_step_number_is_an_error(tmp_path, content):
    (tmp_path / layout.TRACKER).write_bytes(content)
    with pytest.raises(CheckpointError) as e:
        layout.read_tracker(tmp_path)
    assert "not a step number" in e.value.what and "checkpoint validate" in e.value.fix


def test_a_tracker_that_is_a_folder_is_an_error(tmp_path):
    (tmp_path / layout.TRACKER).mkdir()
    with pytest.raises(CheckpointError, match="cannot be read"):
        layout.read_tracker(tmp_path)


def test_step_folders_match_exactly(tmp_path):
    for name in ("global_step_5\n", "global_step_٣", "global_step_5x", "global_step_6"):
        (tmp_path / name).mkdir()
    assert list(layout.step_dirs(tmp_path)) == [6]


@pytest.mark.parametrize(
    "entry",
    [
        {"frozen": "../../../outside.parquet"},
        {"frozen": "/etc/passwd"},
        {"frozen": "data/" + "a" * 64 + ".parquet", "sha256": "b" * 64},  # a copy named for other bytes
        {"sha256": "../" + "a" * 61},
        {"role": "../train"},
    ],
)
def test_a_run_record_naming_frozen_data_outside_the_run_is_refused(tmp_path, entry):
    from relay.data.fingerprint import DataError
    from relay.data.freeze import frozen_files, verify_frozen

    sha = "a" * 64
    f = {
        "role": "train",
        "source": "/x.parquet",
        "sha256": sha,
        "size": 1,
        "rows": 1,
        "schema": "",
        "frozen": f"data/{sha}.parquet",
        "uri": "s3://relay/runs/r/data/x.parquet",
        **entry,
    }
    files.atomic_write_json(layout.relay_dir(tmp_path, "run.json"), {"data": {"files": [f]}})
    with pytest.raises(DataError) as e:
        verify_frozen(tmp_path, frozen_files(tmp_path))
    assert "run.json" in e.value.what and e.value.fix
    assert not (tmp_path.parent / "outside.parquet").exists()


def test_a_damaged_run_record_is_an_error_not_a_crash(tmp_path):
    from relay.common.errors import RunError
    from relay.runs.record import read_record

    layout.relay_dir(tmp_path).mkdir(parents=True)
    for content in (b"{not json", b"[1, 2]", b"\xff" * 10, b"[" * 100000):
        layout.relay_dir(tmp_path, "run.json").write_bytes(content)
        with pytest.raises(RunError) as e:
            read_record(tmp_path)
        assert "run.json" in e.value.what


def test_relay_errors_name_the_value_and_the_fix():
    """Every refusal above is a RelayError: what failed, and what to do."""
    for exc in (SpecError("s", "k", "p", "f"), CheckpointError("w", "f")):
        assert isinstance(exc, RelayError) and "What to do: f" in str(exc)
    assert json.loads(_manifest({}))["files"] == {}
    assert Path(files.check_relpath("actor/x.pt", "m")) == Path("actor/x.pt")
