"""Checkpoints are only ever loaded with weights_only, and verl's own (unpickling) loaders never see a
checkpoint the gate has not just proven safe. An AST scan of the package: a new torch.load without
weights_only=True (outside the listed restricted loads), a pickle.load, an Unpickler without its own find_class, a
call of verl's load_checkpoint or a verl resume, or remote code in transformers fails here, naming the file and
line."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from support.helpers import ROOT

PACKAGE = ROOT / "plugins" / "relay"
SOURCES = sorted(p for p in [*PACKAGE.rglob("*.py"), *(ROOT / "dags").rglob("*.py")] if "__pycache__" not in p.parts)

# Places allowed to hand a checkpoint to verl's own (unpickling) loaders or to name them, each with why it is
# safe. A new one must be added here, in review. "recheck": the site re-checks the files byte for byte
# against their manifest just before verl reads them (enforced below); the others rely on Relay's resume
# having validated the checkpoint, every level with weights_only, just before the job's trainer starts
# (see docs/SECURITY.md: the window between that validation and verl's load).
VERL_LOADER_SITES = {
    ("publication.py", "export_hf"): (
        "recheck",
        "verl's model merger runs only on a checkpoint that passed the "
        "gate, re-checked against its manifest (unchanged_since_validation)",
    ),
    ("chunk_trainer.py", "_load_checkpoint"): (
        "recheck",
        "verl resumes only from the step Relay's resume validated, "
        "re-checked against its manifest just before verl's "
        "loader reads it; a different step is refused",
    ),
    ("overrides.py", "chunk_overrides"): (
        "validated",
        "resume_mode=auto: verl reads the tracker, which Relay's resume has just pointed at a validated checkpoint",
    ),
    ("overrides.py", "<module>"): ("text", "the module's docstring"),
    ("settings.py", "<module>"): ("text", "RELAY_OWNED_KEYS: names the keys so that a spec cannot set them"),
}


# Places allowed to call torch.load with weights_only=False, because they pass a restricted pickle module (an
# Unpickler whose find_class refuses what is not listed): torch's own weights_only reader cannot read them.
RESTRICTED_TORCH_LOADS = {
    ("queue_pickles.py", "_storage_from_bytes"): "a tensor storage's bytes inside verl's TransferQueue pickles "
    "(torch.storage._load_from_bytes' format); its unpickler resolves no global",
}


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _name(node) -> str:
    """Dotted name of a call's function: torch.load, pickle.loads, self.ckpt.load_checkpoint..."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _enclosing_functions(tree):
    out = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                out[id(node)] = fn.name  # ast.walk is breadth first: the innermost function wins
    return out


def _where(path: Path, node) -> str:
    return f"{path.relative_to(ROOT)}:{node.lineno}"


def test_the_scan_sees_the_package():
    assert any(p.name == "safeload.py" for p in SOURCES) and len(SOURCES) > 30


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_unsafe_loading(path):
    tree = ast.parse(path.read_text(), str(path))
    funcs = _enclosing_functions(tree)
    problems = []
    for call in _calls(tree):
        name = _name(call.func)
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        restricted = (path.name, funcs.get(id(call), "<module>")) in RESTRICTED_TORCH_LOADS and "pickle_module" in kw
        if name in ("torch.load", "torch.serialization.load") or name.endswith(".torch.load"):
            wo = kw.get("weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True) and not restricted:
                problems.append(f"{_where(path, call)}: {name}(...) without weights_only=True")
        if name.split(".")[-1] in ("load", "loads", "Unpickler") and name.split(".")[0] in (
            "pickle",
            "dill",
            "cloudpickle",
            "joblib",
        ):
            problems.append(f"{_where(path, call)}: {name}(...) unpickles arbitrary objects")
        if name.endswith("load_checkpoint"):
            if (path.name, funcs.get(id(call), "<module>")) not in VERL_LOADER_SITES:
                problems.append(f"{_where(path, call)}: {name}(...) is verl's loader (weights_only=False)")
        if "trust_remote_code" in kw and not (
            isinstance(kw["trust_remote_code"], ast.Constant) and kw["trust_remote_code"].value is False
        ):
            problems.append(f"{_where(path, call)}: trust_remote_code runs a model repository's code")
        if name.endswith("numpy.load") or name.endswith("np.load"):
            ap = kw.get("allow_pickle")
            if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                problems.append(f"{_where(path, call)}: numpy.load with allow_pickle")
    restricted_args = {
        id(k.value)
        for call in _calls(tree)
        if (path.name, funcs.get(id(call), "<module>")) in RESTRICTED_TORCH_LOADS
        for k in call.keywords
        if any(j.arg == "pickle_module" for j in call.keywords)
    }
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.keyword)
            and node.arg == "weights_only"
            and isinstance(node.value, ast.Constant)
            and node.value.value is False
            and id(node.value) not in restricted_args
        ):
            problems.append(f"{_where(path, node.value)}: weights_only=False")
        if isinstance(node, ast.ClassDef) and any(_name(b).endswith("Unpickler") for b in node.bases):
            if not any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in node.body):
                problems.append(f"{_where(path, node)}: an Unpickler without its own find_class unpickles anything")
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and ("verl.model_merger" in node.value or "resume_mode" in node.value or "resume_from_path" in node.value)
        ):
            if (path.name, funcs.get(id(node), "<module>")) not in VERL_LOADER_SITES:
                problems.append(
                    f"{_where(path, node)}: {node.value!r} hands a checkpoint to verl's own loader; add "
                    f"the site to VERL_LOADER_SITES with why the files are proven safe just before"
                )
    assert not problems, "\n".join(problems)


def test_verl_loader_sites_recheck_the_files_first():
    """Each "recheck" site calls unchanged_since_validation before it starts verl."""
    for (file, func), (kind, why) in VERL_LOADER_SITES.items():
        if kind != "recheck":
            continue
        path = next(p for p in SOURCES if p.name == file)
        tree = ast.parse(path.read_text())
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == func)
        calls = sorted(_calls(fn), key=lambda c: (c.lineno, c.col_offset))
        names = [_name(c.func) for c in calls]
        assert "unchanged_since_validation" in names, f"{file}:{func} must re-check the files ({why})"
        # verl's loader: the merger's subprocess, or the trainer's own _load_checkpoint
        first_run = next(i for i, n in enumerate(names) if n.startswith("subprocess.") or n.endswith("_load_checkpoint"))
        assert names.index("unchanged_since_validation") < first_run


def test_a_pickle_that_runs_code_is_refused_and_never_runs(tmp_path):
    import torch

    from relay.checkpoints import safeload
    from relay.common.errors import UnsafeCheckpointError

    marker = tmp_path / "code-ran"

    class RunsCode:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"x": RunsCode()}, tmp_path / "evil.pt")
    with pytest.raises(UnsafeCheckpointError) as e:
        safeload.load(tmp_path / "evil.pt")
    assert "nothing in it was executed" in e.value.what and "system" in e.value.what
    assert not marker.exists()


def test_a_file_changed_after_validation_is_never_given_to_verls_merger(tmp_path):
    """export_hf's guard: a checkpoint whose actor files differ from the manifest is refused."""
    from relay.checkpoints import manifest
    from relay.checkpoints.integrity import scan
    from relay.checkpoints.manifest import unchanged_since_validation
    from relay.common.errors import CheckpointError

    step = tmp_path / "global_step_3"
    (step / "actor").mkdir(parents=True)
    shard = step / "actor" / "model_world_size_1_rank_0.pt"
    import torch

    torch.save({"w": torch.ones(3)}, shard)
    s = scan(shard)
    manifest.Manifest(
        run="r",
        step=3,
        world_size=1,
        fsdp_version=2,
        params={},
        files={"actor/model_world_size_1_rank_0.pt": {"size": s.size, "crc64nvme": s.crc64nvme}},
    ).write(step)
    unchanged_since_validation(step, "actor/")  # whole: passes
    torch.save({"w": torch.zeros(3)}, shard)  # swapped after validation
    with pytest.raises(CheckpointError, match="changed since validation"):
        unchanged_since_validation(step, "actor/")
    (step / "actor" / "extra.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"extra\.pt"):
        unchanged_since_validation(step, "actor/")
