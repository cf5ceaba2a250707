"""Checkpoint validation: verl's own checkpoints pass at every world size and FSDP version; each defect
is refused with the right check named, quarantined, and never published."""

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from relay.checkpoints import manifest
from relay.checkpoints.gate import admit_dir
from relay.checkpoints.resume import find_resume_point
from relay.checkpoints.validate import validate_checkpoint
from relay.runs import layout
from support import verl_checkpoint
from support.corrupt import DEFECTS
from support.helpers import relay_cli

KINDS = [(1, 1), (1, 2), (2, 1), (2, 2)]  # (FSDP version, world size)


@pytest.fixture(scope="session")
def verl_checkpoints(tmp_path_factory):
    """Run folders holding global_step_1, written by verl's FSDPCheckpointManager in gloo processes: one per
    (FSDP version, world size), and "wider" (hidden size 48, FSDP2, world size 1)."""
    root = tmp_path_factory.mktemp("verl_checkpoints")
    made = verl_checkpoint.make_many(
        [{"run_dir": root / f"fsdp{f}_ws{w}", "world_size": w, "fsdp": f} for f, w in KINDS]
        + [{"run_dir": root / "wider", "hidden": 48}]
    )
    return {k: step.parent for k, step in zip([*KINDS, "wider"], made, strict=True)}


def copy_run(verl_checkpoints, tmp_path, fsdp=2, ws=1) -> Path:
    dest = tmp_path / f"run_fsdp{fsdp}_ws{ws}"
    shutil.copytree(verl_checkpoints[(fsdp, ws)], dest)
    return dest


@pytest.mark.parametrize("fsdp,ws", KINDS, ids=[f"FSDP{f}-ws{w}" for f, w in KINDS])
def test_verl_checkpoints_validate_at_every_world_size(verl_checkpoints, tmp_path, fsdp, ws):
    run = copy_run(verl_checkpoints, tmp_path, fsdp, ws)
    admission = admit_dir(run)
    assert admission.ok, admission.explain()
    assert [c.name for c in admission.report.checks] == ["structure", "consistency", "integrity", "loadability", "numerics"]
    assert admission.report.world_size == ws and admission.report.fsdp_version == fsdp
    m = manifest.read(run / "global_step_1")
    assert m.world_size == ws and set(m.files) == set(manifest.checkpoint_files(run / "global_step_1"))
    # Global parameter shapes, whatever the sharding.
    assert m.params["model.embed_tokens.weight"] == [64, 32, "float32"]


ACTOR = "global_step_1/actor"


@pytest.mark.services
@pytest.mark.parametrize("defect", list(DEFECTS))
def test_each_defect_is_refused_quarantined_and_never_published(verl_checkpoints, tmp_path, defect):
    breaks, check, words = DEFECTS[defect]
    run = copy_run(verl_checkpoints, tmp_path, fsdp=1, ws=1)
    breaks(run / "global_step_1")
    uri = f"s3://relay/test-defect-{tmp_path.name}"
    r = relay_cli("checkpoint", "publish", str(run), uri)
    assert r.returncode == 1, r.stdout + r.stderr
    admission_text = r.stderr
    assert f"✘ {check}:" in admission_text and words in admission_text, admission_text
    assert "quarantined to" in admission_text
    assert not (run / "global_step_1").exists() and list((run / ".relay" / "quarantine").glob("global_step_1.*"))
    assert not (run / ACTOR / "PWNED").exists() and not list(run.rglob("PWNED")), "the pickle's code ran"
    listing = relay_cli("checkpoint", "ls", uri, "--json")
    assert listing.returncode == 0 and listing.stdout.strip() == "[]", "nothing of it was published"


def test_tracker_defects(verl_checkpoints, tmp_path):
    run = copy_run(verl_checkpoints, tmp_path)
    layout.write_tracker(run, 7)
    report = validate_checkpoint(run)
    assert report.failed.name == "structure" and "global_step_7 does not exist" in report.failed.detail
    layout.tracker_path(run).write_bytes(b"\x00garbage")
    report = validate_checkpoint(run)
    assert report.failed.name == "structure" and "not a step number" in report.failed.detail
    # The resume falls back to the newest valid checkpoint instead of starting again at step 0.
    point = find_resume_point(run)
    assert point.step == 1 and layout.read_tracker(run) == 1


@pytest.mark.services
def test_a_changed_world_size_is_refused(verl_checkpoints, tmp_path):
    run = copy_run(verl_checkpoints, tmp_path, fsdp=2, ws=2)
    shutil.copytree(verl_checkpoints[(2, 1)] / "global_step_1", run / "global_step_2")
    layout.write_tracker(run, 2)
    report = validate_checkpoint(run)
    assert report.failed.name == "consistency"
    assert "world size 1, but the run's earlier checkpoint (step 1) has world size 2" in report.failed.detail
    uri = f"s3://relay/test-ws-{tmp_path.name}"
    r = relay_cli("checkpoint", "publish", str(run), uri)
    assert r.returncode == 1 and "✘ consistency" in r.stderr and "quarantined to" in r.stderr
    assert layout.read_tracker(run) == 1, "the tracker falls back to the newest valid checkpoint"
    assert relay_cli("checkpoint", "ls", uri, "--json").stdout.strip() == "[]"


def test_a_critic_is_required_when_the_algorithm_has_one(verl_checkpoints, tmp_path):
    run = copy_run(verl_checkpoints, tmp_path)
    report = validate_checkpoint(run, expect_critic=True)
    assert report.failed.name == "structure" and "critic/ (the algorithm has a critic)" in report.failed.detail
    shutil.copytree(run / ACTOR, run / "global_step_1" / "critic")
    assert validate_checkpoint(run, expect_critic=True).ok


def test_an_async_steps_transfer_queue_pickles_are_checked_and_a_crafted_one_is_quarantined(verl_checkpoints, tmp_path):
    """verl's async trainers save their TransferQueue in the step folder; the queue unpickles it at a resume. The
    gate reads every pickle there through the restricted unpickler: the queue's own state passes, a crafted pickle
    is quarantined with the type it asked for, nothing in it runs, and `relay checkpoint validate` refuses it."""
    import pickle

    from support import queue_state

    run = copy_run(verl_checkpoints, tmp_path)
    queue_state.write(run / "global_step_1")
    admission = admit_dir(run)
    assert admission.ok, admission.explain()
    assert "2 TransferQueue pickles through the restricted unpickler" in admission.report.summary()

    crafted = copy_run(verl_checkpoints, tmp_path / "crafted")
    queue = queue_state.write(crafted / "global_step_1")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (queue / "controller_state.pkl").write_bytes(pickle.dumps({"controller_id": Payload()}))
    cli = relay_cli("checkpoint", "validate", str(crafted))
    assert cli.returncode == 1 and f"{os.system.__module__}.system" in cli.stdout, cli.stdout + cli.stderr
    refused = admit_dir(crafted)
    assert not refused.ok and refused.report.failed.name == "loadability", refused.explain()
    assert "controller_state.pkl is unsafe: unpickling it needs posix.system" in refused.report.failed.detail
    assert refused.quarantined_to and not (crafted / "global_step_1").exists() and not marker.exists()


def test_consistency_with_the_expected_chunk_end(verl_checkpoints, tmp_path):
    run = copy_run(verl_checkpoints, tmp_path)
    report = validate_checkpoint(run, 1, expected_step=20)
    assert report.failed.name == "consistency" and "the chunk ends at step 20" in report.failed.detail


def test_rotation_leftovers_are_recognised(verl_checkpoints, tmp_path):
    run = copy_run(verl_checkpoints, tmp_path)
    (run / "global_step_2").mkdir()
    (run / "global_step_2" / "data.pt").write_bytes(b"x")
    layout.write_tracker(run, 2)
    assert "rotation leftover" in validate_checkpoint(run).failed.detail
    assert find_resume_point(run).step == 1


def test_a_file_changed_after_validation_is_caught_before_use(verl_checkpoints, tmp_path):
    run = copy_run(verl_checkpoints, tmp_path)
    assert admit_dir(run).ok
    cfg = run / ACTOR / "huggingface" / "config.json"
    cfg.write_text(cfg.read_text().replace('"vocab_size": 64', '"vocab_size": 65'))
    report = validate_checkpoint(run)
    assert report.failed.name == "integrity" and "changed since validation" in report.failed.detail


def test_parameter_shapes_must_match_the_previous_checkpoint(verl_checkpoints, tmp_path):
    run = copy_run(verl_checkpoints, tmp_path)
    assert admit_dir(run).ok
    shutil.copytree(verl_checkpoints["wider"] / "global_step_1", run / "global_step_2")
    layout.write_tracker(run, 2)
    report = validate_checkpoint(run)
    assert report.failed.name == "numerics" and "at step 1 it had" in report.failed.detail


@pytest.mark.processes
def test_checkpoint_validate_runs_the_safe_checks_by_default(verl_checkpoints, tmp_path):
    """`relay checkpoint validate DIR`, no flags: NaN weights and a pickle that would run code are refused
    (exit 1) with the check named; --quick keeps structure, consistency and integrity only."""
    from support import corrupt

    run = copy_run(verl_checkpoints, tmp_path)
    ok = relay_cli("checkpoint", "validate", str(run))
    assert ok.returncode == 0 and "numerics" in ok.stdout and "loadability" in ok.stdout, ok.stdout + ok.stderr
    corrupt.nan(corrupt.shard(run / "global_step_1", "model"))
    refused = relay_cli("checkpoint", "validate", str(run))
    assert refused.returncode == 1 and "✘ numerics" in refused.stdout, refused.stdout
    quick = relay_cli("checkpoint", "validate", str(run), "--quick")
    assert quick.returncode == 0 and "numerics" not in quick.stdout, quick.stdout
    assert relay_cli("checkpoint", "validate", str(run), "--deep").returncode == 1  # still accepted

    evil = copy_run(verl_checkpoints, tmp_path / "evil")
    marker = tmp_path / corrupt.MARKER
    corrupt.runs_code(corrupt.shard(evil / "global_step_1", "extra_state"), marker)
    refused = relay_cli("checkpoint", "validate", str(evil))
    assert refused.returncode == 1 and "✘ loadability" in refused.stdout and not marker.exists(), refused.stdout


@pytest.mark.parametrize("parallel", [False, True], ids=["one-thread", "segments-in-parallel"])
def test_integrity_in_segments_equals_one_pass_and_catches_a_byte_across_a_boundary(tmp_path, monkeypatch, parallel):
    """A file checksummed segment by segment (here 64 KiB each, so tensors span segments) gives the
    whole file's CRC64NVME and every zip entry's CRC32 as one sequential pass does; one altered byte in
    a tensor that spans a boundary is named."""
    import zipfile
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from awscrt import checksums

    from relay.checkpoints import integrity

    monkeypatch.setattr(integrity, "SEGMENT", 64 << 10)
    path = tmp_path / "model_world_size_1_rank_0.pt"
    torch.save({"a": torch.arange(100_000, dtype=torch.float32), "b": torch.ones(3, 70_000)}, path)
    data = path.read_bytes()
    with ThreadPoolExecutor(2) as pool:
        scan = integrity.scan(path, pool=pool if parallel else None)
    assert scan.problem is None and scan.size == len(data)
    assert scan.crc64nvme == integrity.crc64nvme_b64(checksums.crc64nvme(data))
    with zipfile.ZipFile(path) as zf:
        big = max(zf.infolist(), key=lambda i: i.file_size)
    assert big.file_size > 3 * integrity.SEGMENT, "the entry spans several segments"
    offset = next(off for name, off, _, _ in integrity.zip_entries(path) if name == big.filename)
    altered = bytearray(data)
    altered[offset + 2 * integrity.SEGMENT - offset % integrity.SEGMENT] ^= 0x10  # a segment's first byte
    path.write_bytes(bytes(altered))
    with ThreadPoolExecutor(2) as pool:
        bad = integrity.scan(path, pool=pool if parallel else None)
    assert bad.problem == f"entry {big.filename} fails its CRC32 check (the bytes were altered)"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_numerics_ride_the_integrity_pass_and_only_a_tensors_own_nan_is_refused(tmp_path, monkeypatch, dtype):
    """The values of a shard's floating-point tensors are checked in the pass that checksums their bytes (in
    blocks that cross segments and entries): a NaN or Inf anywhere in a tensor is refused with the tensor named;
    finite values at the dtype's limit pass (a float32 sum overflows: the tensor-by-tensor check decides), and so
    does a NaN in a storage's bytes that no saved tensor views."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from relay.checkpoints import integrity
    from relay.checkpoints.validate import check_file

    monkeypatch.setattr(integrity, "SEGMENT", 64 << 10)
    monkeypatch.setattr(integrity, "BLOCK", 16 << 10)
    dt = getattr(torch, dtype)
    rel = "model_world_size_1_rank_0.pt"
    clean = {"a": torch.randn(300, 257).to(dt), "steps": torch.arange(40), "b": torch.randn(1001).to(dt)}

    def checked(state: dict):
        torch.save(state, tmp_path / rel)
        with ThreadPoolExecutor(2) as pool:
            return check_file(tmp_path, rel, pool=pool)

    ok = checked(clean)
    assert (ok.scan.problem, ok.load_error, ok.nonfinite, ok.scan.nonfinite) == (None, None, None, [])
    assert ok.params["a"] == [300, 257, dtype]
    for value in (float("nan"), float("inf")):
        for name, index in (("a", 300 * 257 - 1), ("a", 40_000), ("b", 0)):
            bad = {k: v.clone() for k, v in clean.items()}
            bad[name].view(-1)[index] = value
            assert checked(bad).nonfinite == f"{rel}: {name} holds NaN or Inf", (value, name, index)
    huge = {**clean, "a": torch.full((300, 257), torch.finfo(dt).max, dtype=dt)}
    largest = checked(huge)
    assert largest.nonfinite is None, "finite values at the dtype's limit pass"
    storage = torch.randn(500).to(dt)
    storage[0] = float("nan")
    outside = checked({"view": storage[100:200]})
    assert outside.scan.nonfinite and outside.nonfinite is None, "a NaN outside every tensor is not the model's"


def certified_offline(step_dir):
    """A certificate of the checkpoint's model as an unsharded model holds it (its pieces put together, loaded into
    the architecture of huggingface/): its parameters' digests by name and the probe's log-probs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from relay.checkpoints import certificate, shards

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(step_dir / "actor" / "huggingface"))
    state = shards.read(step_dir).full(torch.float32)
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, strict=True)
    ids = [[1, 5, 9, 3], [2, 7]]
    certificate.Certificate(
        step=1,
        world_size=shards.read(step_dir).world_size,
        device="cpu",
        probe_ids=ids,
        logprobs=certificate.probe_logprobs(model.eval(), ids, 0),
        params=certificate.param_digests(model),
    ).write(step_dir)


SPEC = SimpleNamespace(settings=SimpleNamespace(attention=None), checkpoints=SimpleNamespace(offline_tolerance=1e-5))


@pytest.mark.parametrize("fsdp,ws", KINDS, ids=[f"FSDP{f}-ws{w}" for f, w in KINDS])
def test_the_gates_smoke_and_certificate_checks_run_at_the_checkpoints_own_world_size(verl_checkpoints, tmp_path, fsdp, ws):
    """verl's checkpoint, FSDP1 or FSDP2, at world size 1 or 2: the smoke check loads the whole model from every
    rank's pieces, and the certificate check digests the pieces where they lie; a row swapped in one rank's shard
    (same shapes, finite, torch's CRCs made again) is refused by the certificate."""
    from relay.checkpoints import certificate
    from relay.trainers.verl_ppo.cpu.tiny_model import byte_tokenizer
    from relay.trainers.verl_ppo.smoke import certify, smoke

    run = copy_run(verl_checkpoints, tmp_path, fsdp, ws)
    step_dir = layout.step_dir(run, 1)
    byte_tokenizer().save_pretrained(step_dir / "actor" / "huggingface")  # verl saves the model's tokenizer there
    certified_offline(step_dir)

    saved = certificate.read(step_dir)
    admission = admit_dir(run, smoke=lambda d: smoke(SPEC, d), certify=lambda d: certify(SPEC, d, saved))
    assert admission.ok, admission.explain()
    summary = admission.report.summary()
    assert "✔ smoke: forward pass" in summary, summary
    assert f"parameter digests equal at world size {ws}, probe log-probs within" in summary, summary

    shard = step_dir / "actor" / layout.shard_name("model", ws, ws - 1)
    sd = safe_torch_load(shard)
    key = next(k for k in sd if k.endswith("mlp.down_proj.weight"))
    swap_first_rows(sd[key])
    torch.save(sd, shard)
    (step_dir / manifest.NAME).unlink()
    refused = admit_dir(run, certify=lambda d: certify(SPEC, d, saved))
    assert not refused.ok and refused.report.failed.name == "certificate", refused.explain()
    assert key in refused.report.failed.detail


def safe_torch_load(path):
    return torch.load(path, weights_only=False)


def swap_first_rows(value):
    """Rows 0 and 1 of this rank's piece swapped in place (a DTensor's local piece, a ShardedTensor's shard)."""
    local = value.to_local() if hasattr(value, "to_local") else value
    if hasattr(value, "local_shards"):
        local = value.local_shards()[0].tensor
    local[[0, 1]] = local[[1, 0]]


def test_a_smoke_check_that_cannot_run_is_recorded_as_skipped_never_as_passed(verl_checkpoints, tmp_path, monkeypatch):
    """A model too large for the gate's host: the smoke check does not run, and the validation output and the manifest
    say so (the checkpoint is still admitted on the levels that ran)."""
    from relay.trainers.verl_ppo import smoke

    monkeypatch.setattr(smoke, "MAX_BYTES", 1000)
    run = copy_run(verl_checkpoints, tmp_path, fsdp=2, ws=2)
    admission = admit_dir(run, smoke=lambda step_dir: smoke.smoke(SPEC, step_dir))
    assert admission.ok
    summary = admission.report.summary()
    assert "- smoke: skipped: the model shards are" in summary and "✔ smoke" not in summary
    m = manifest.read(layout.step_dir(run, 1))
    assert "smoke" not in m.checks and m.checks[-1] == "numerics"
    assert m.skipped["smoke"].startswith("the model shards are")


def test_the_gate_quarantines_only_the_folder_it_validated(verl_checkpoints, tmp_path):
    """A writer puts another copy of the step in place (a restore, a trainer's commit) while the gate validates the
    first, which fails: the gate quarantines nothing it did not validate; it validates the new folder, which passes."""
    from relay.runs.lease import Lease

    run = copy_run(verl_checkpoints, tmp_path)
    step_dir = layout.step_dir(run, 1)
    good = shutil.copytree(step_dir, tmp_path / "good")
    smoked = []

    def smoke(folder: Path) -> str:
        smoked.append(folder)
        if len(smoked) == 1:
            with Lease(run).locked("a restore of step 1"):
                step_dir.rename(tmp_path / "the-first-folder")
                shutil.copytree(good, step_dir)
            raise RuntimeError("logits are NaN")
        return "finite logits"

    admission = admit_dir(run, 1, smoke=smoke)
    assert len(smoked) == 2 and admission.ok, admission.explain()
    assert step_dir.is_dir() and not layout.relay_dir(run, "quarantine").exists(), "the new folder was not quarantined"
    assert layout.read_tracker(run) == 1
