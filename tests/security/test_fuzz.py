"""Property tests (hypothesis) of the readers that take input Relay did not write itself: the spec loader,
the tracker reader and the manifest reader. Random and malformed input gives either a value or a
RelayError with a message (and, for a spec, the key it names), never another exception or a crash
trace. Small, derandomized budgets: the same examples on every run, a few seconds in all."""

from __future__ import annotations

import json
import string

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from relay.checkpoints import manifest
from relay.common import files
from relay.common.errors import CheckpointError, RelayError, SpecError
from relay.runs import layout
from support.helpers import spec_dict

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

SPEC_KEYS = [
    "name",
    "description",
    "trainer",
    "kind",
    "settings",
    "total_steps",
    "chunk_steps",
    "seed",
    "threads",
    "checkpoint_dir",
    "data",
    "train_files",
    "val_files",
    "on_source_change",
    "expectations",
    "checkpoints",
    "ray",
    "env_vars",
    "s3",
    "uri",
    "acl",
    "server_side_encryption",
    "kms_key_id",
    "alerts",
    "email",
    "airflow",
    "retries",
    "schedule",
    "model",
    "optim",
    "lr",
    "save_freq",
    "rollout_n",
]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(
        [
            "${HOME}",
            "${RELAY_UNSET_X}",
            "s3://relay/../x",
            "../..",
            "\x00",
            "{{ ds }}",
            "{{ nope }}",
            "@daily",
            "0 3 * * 1",
            "tiny_grpo",
            "AES256",
            "aws:kms",
            "1e309",
        ]
    )
)
json_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(SPEC_KEYS) | st.text(max_size=10), inner, max_size=5),
    max_leaves=25,
)


def _set(d: dict, dotted: str, value) -> dict:
    node = d
    *parents, leaf = dotted.split(".")
    for p in parents:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[leaf] = value
    return d


def _paths(d, prefix=""):
    for k, v in d.items():
        yield prefix + k
        if isinstance(v, dict):
            yield from _paths(v, prefix + k + ".")


DEMO_KEYS = sorted(_paths(spec_dict()))


def _spec_outcome(raw, tmp_path, **kw):
    from relay.spec.run_spec import spec_from_dict

    try:
        return spec_from_dict(raw, **kw)
    except SpecError as e:
        assert e.problem and str(e).startswith("run spec "), str(e)
        return e


@pytest.fixture
def project_root(tmp_path, monkeypatch):
    """Relative spec paths resolve under a temporary root (environment checks write a probe file)."""
    monkeypatch.setenv("RELAY_PROJECT_ROOT", str(tmp_path))
    return tmp_path


@FUZZ
@given(raw=json_like)
def test_any_structure_is_a_spec_or_a_spec_error(raw, project_root):
    _spec_outcome(raw, project_root, check_environment=False)


@FUZZ
@given(key=st.sampled_from(DEMO_KEYS), value=json_like, environment=st.booleans())
def test_the_demo_spec_with_one_key_broken_is_a_spec_error_naming_it(key, value, environment, project_root):
    raw = _set(spec_dict(), key, value)
    out = _spec_outcome(raw, project_root, check_environment=environment)
    if isinstance(out, SpecError) and key.split(".")[0] not in ("data",) and out.key:
        # the error names a key; for a broken leaf it is the key itself or one inside it
        assert out.key.split("[")[0].split(".")[0] == key.split(".")[0] or environment, (key, out.key, str(out))


@FUZZ
@given(extra=st.text(max_size=12), value=json_like)
def test_an_unknown_key_is_named_with_a_suggestion(extra, value, project_root):
    from relay.spec.run_spec import RunSpec

    assume(extra and extra not in spec_dict() and extra not in RunSpec.model_fields)  # a key the demo leaves out
    out = _spec_outcome({**spec_dict(), extra: value}, project_root, check_environment=False)
    assert isinstance(out, SpecError) and out.key == extra and "known keys here" in (out.fix or "")


@FUZZ
@given(text=st.text(max_size=300) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
def test_any_file_is_a_spec_or_a_spec_error(text, tmp_path_factory):
    from relay.spec.run_spec import load_spec

    path = tmp_path_factory.mktemp("spec") / "s.yaml"
    path.write_text(text, errors="surrogateescape")
    try:
        load_spec(path, check_environment=False)
    except SpecError as e:
        assert str(e).startswith(f"run spec {path}")


@pytest.mark.parametrize(
    "text",
    [
        "[" * 5000,
        "a: " + "[" * 5000,
        "{" * 3000,
        "- " * 4000 + "x",
        "a: &a [1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b]\nd: [*c, *c, *c]",
        "!!python/object/apply:os.system ['true']",
        "? [a, b]\n: c",
        "\ufeffname: x",
        "name: 2024-01-01",
    ],
)
def test_hostile_yaml_is_a_spec_error(text, tmp_path):
    from relay.spec.run_spec import load_spec

    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(SpecError):
        load_spec(path, check_environment=False)


def test_found_by_fuzzing_nul_paths_deep_values_and_non_utf8(tmp_path, project_root):
    from relay.spec.run_spec import load_spec, spec_from_dict

    with pytest.raises(SpecError) as e:
        spec_from_dict(_set(spec_dict(), "checkpoint_dir", "ckpt\x00"))
    assert e.value.key == "checkpoint_dir" and "control character" in e.value.problem
    deep = 1
    for _ in range(3000):
        deep = [deep]
    with pytest.raises(SpecError) as e:
        spec_from_dict(_set(spec_dict(), "description", deep), check_environment=False)
    assert e.value.key == "description" and len(str(e.value)) < 400
    (tmp_path / "latin1.yaml").write_bytes("name: d\xe9mo\n".encode("latin-1"))
    with pytest.raises(SpecError, match="not UTF-8"):
        load_spec(tmp_path / "latin1.yaml", check_environment=False)


@FUZZ
@given(blob=st.text(max_size=200) | json_like.map(json.dumps))
def test_a_chunk_request_spec_blob_is_a_spec_or_a_spec_error(blob):
    from relay.spec.run_spec import spec_from_json

    try:
        spec_from_json(blob)
    except SpecError:
        pass


# ------------------------------------------------------------------------------------ the tracker


@FUZZ
@given(content=st.binary(max_size=80) | st.text(alphabet=string.digits + " \n\t\r+-_.x²١٢", max_size=30).map(str.encode))
def test_any_tracker_is_a_step_or_a_checkpoint_error(content, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / layout.TRACKER).write_bytes(content)
    try:
        step = layout.read_tracker(run_dir)
    except CheckpointError as e:
        assert "not a step number" in e.what and e.fix
        return
    assert isinstance(step, int) and step >= 0 and str(step) == content.decode().strip().lstrip("0").rjust(1, "0")


# ------------------------------------------------------------------------------------ the manifest


def _valid_manifest() -> dict:
    return json.loads(
        manifest.Manifest(
            run="r",
            step=6,
            world_size=1,
            fsdp_version=2,
            params={"w": [2, 3, "f32"]},
            files={"actor/model_world_size_1_rank_0.pt": {"size": 10, "crc64nvme": "AAAAAAAAAAA="}},
        ).to_json()
    )


MANIFEST_KEYS = sorted(_valid_manifest())


def _manifest_outcome(text):
    try:
        m = manifest.Manifest.from_json(text, "m.json")
    except CheckpointError as e:
        assert e.what.startswith("m.json ") and e.fix
        return e
    assert all(files.relpath_problem(rel) is None for rel in m.files)
    assert isinstance(m.step, int) and m.step >= 0
    return m


@FUZZ
@given(text=st.text(max_size=300) | st.binary(max_size=300) | json_like.map(json.dumps))
def test_any_text_is_a_manifest_or_a_checkpoint_error(text):
    _manifest_outcome(text)


@FUZZ
@given(
    key=st.sampled_from([*MANIFEST_KEYS, "files.rel", "files.size", "files.crc", "extra"]),
    value=json_like,
    rel=st.text(max_size=30),
)
def test_a_manifest_with_one_field_broken_is_a_manifest_or_a_checkpoint_error(key, value, rel):
    d = _valid_manifest()
    if key == "files.rel":
        d["files"] = {rel: {"size": 1, "crc64nvme": "x"}}
    elif key == "files.size":
        d["files"] = {"a.pt": {"size": value, "crc64nvme": "x"}}
    elif key == "files.crc":
        d["files"] = {"a.pt": {"size": 1, "crc64nvme": value}}
    elif key == "extra":
        d[rel or "x"] = value
    else:
        d[key] = value
    _manifest_outcome(json.dumps(d))


@FUZZ
@given(content=st.binary(max_size=200))
def test_a_manifest_file_of_any_bytes_reads_or_is_a_checkpoint_error(content, tmp_path_factory):
    step_dir = tmp_path_factory.mktemp("step")
    (step_dir / manifest.NAME).write_bytes(content)
    try:
        manifest.read(step_dir)
    except CheckpointError:
        pass


def test_every_error_here_is_a_relay_error():
    assert issubclass(SpecError, RelayError) and issubclass(CheckpointError, RelayError)
    assert yaml.safe_load("a: 1") == {"a": 1}
