"""The CPU trainer certifies every resume (relay.checkpoints.certificate): a resumed chunk says so, and a
checkpoint whose files are whole but whose values moved is refused, quarantined, and the run goes on from the
checkpoint before it, bit for bit as an uninterrupted run. The gate checks certificates offline, and a Hugging
Face export is published only if it reproduces its checkpoint's."""

import shutil

import pytest
import torch

from relay.checkpoints import certificate
from relay.runs import layout
from relay.runs.metrics import read_events
from support.helpers import DELETE, assert_bitwise_equal, model_state, read_metrics, relay_cli, train, write_spec

pytestmark = pytest.mark.processes  # trainer jobs in processes of their own: not in the fast lane


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The test spec saving every 3 steps (no S3): an uninterrupted run 0 -> 12, and a run 0 -> 6 to copy."""
    root = tmp_path_factory.mktemp("certified")
    spec = write_spec(root, **{"s3": DELETE, "trainer.settings.save_freq": 3})
    train(spec, root / "straight", 12)
    train(spec, root / "six", 6)
    return {"spec": spec, "straight": root / "straight", "six": root / "six"}


def run_at_six(trained, tmp_path):
    return shutil.copytree(trained["six"], tmp_path / "run")


def events(run_dir, kind):
    return [e for e in read_events(run_dir) if e["event"] == kind]


def swap_rows(step_dir, suffix="mlp.down_proj.weight") -> str:
    """Two rows of one matrix of the model swapped, re-saved by torch (its own CRCs hold); the manifest removed,
    as for a checkpoint never validated."""
    shard = step_dir / "actor" / layout.shard_name("model", 1, 0)
    sd = torch.load(shard, weights_only=False)
    key = next(k for k in sd if k.endswith(suffix))
    local = sd[key].to_local() if hasattr(sd[key], "to_local") else sd[key]
    local[[0, 1]] = local[[1, 0]]
    torch.save(sd, shard)
    (step_dir / "relay_manifest.json").unlink(missing_ok=True)
    return key


def test_a_row_swap_that_keeps_every_crc_is_refused_at_resume_and_the_run_falls_back(trained, tmp_path):
    spec, run = trained["spec"], run_at_six(trained, tmp_path)
    cert = certificate.read(layout.step_dir(run, 6))
    # two optimizer steps a training step (two mini-batches)
    assert cert is not None and cert.step == 6 and cert.optimizer_step == 12 and len(cert.probe_ids) == 4

    key = swap_rows(layout.step_dir(run, 6))
    refused = relay_cli("train", str(spec), "--to-step", "12", "--checkpoint-dir", str(run))
    assert refused.returncode != 0
    out = refused.stdout + refused.stderr
    assert "certificate does not hold" in out and key.removeprefix("_fsdp_wrapped_module.") in out, out[-3000:]
    [event] = events(run, "certificate_refused")
    assert event["step"] == 6 and event["fell_back_to"] == 3 and "parameters hold other values" in event["detail"]
    assert [e["check"] for e in events(run, "quarantine")] == ["certificate"]
    assert layout.read_tracker(run) == 3 and not layout.step_dir(run, 6).exists()

    inspected = relay_cli("checkpoint", "inspect", str(layout.step_dir(run, 3)))
    assert "certificate      step 3 at world size 1 on cpu: probe of 4 sequences" in inspected.stdout, inspected.stdout

    again = train(spec, run, 12)
    assert "certified resume from step 3" in again.stdout, again.stdout[-2000:]
    assert_bitwise_equal(model_state(run / "global_step_12"), model_state(trained["straight"] / "global_step_12"))
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 13))
    assert [e.get("certificate") for e in events(run, "chunk_start")] == [None, "certified"]
    report = relay_cli("report", str(run))
    assert "chunk 2 resumed from step 3 (certified resume)" in report.stdout, report.stdout[-3000:]


def swap_moment_rows(step_dir) -> str:
    """Two rows of one parameter's Adam exp_avg swapped in the optimizer's shard, re-saved by torch; the manifest
    removed. The parameter it belongs to, as the certificate names its moments."""
    shard = step_dir / "actor" / layout.shard_name("optim", 1, 0)
    sd = torch.load(shard, weights_only=False)

    def find(node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "exp_avg" and getattr(v, "ndim", 0) >= 2:
                    return path, v
                if (got := find(v, [*path, k])) is not None:
                    return got
        return None

    path, moment = find(sd, [])
    local = moment.to_local() if hasattr(moment, "to_local") else moment
    local[[0, 1]] = local[[1, 0]]
    torch.save(sd, shard)
    (step_dir / "relay_manifest.json").unlink(missing_ok=True)
    return str(path[-1])


def test_optimizer_moments_altered_under_a_kept_certificate_are_refused_at_resume(trained, tmp_path):
    spec, run = trained["spec"], run_at_six(trained, tmp_path)
    cert = certificate.read(layout.step_dir(run, 6))
    assert cert is not None and len(cert.optimizer) == 2 * len(cert.params) and cert.optimizer_steps == [12]
    swap_moment_rows(layout.step_dir(run, 6))
    refused = relay_cli("train", str(spec), "--to-step", "7", "--checkpoint-dir", str(run))
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "optimizer moments hold other values than saved" in out, out[-3000:]
    assert ".exp_avg" in out and layout.read_tracker(run) == 3, out[-3000:]


def test_a_certificate_deleted_with_the_manifest_is_refused_at_resume_and_by_the_gate(trained, tmp_path):
    """Altered weights whose certificate and manifest were both removed: the commit record of step 6 (outside the
    step folder) names a certificate, so the resume's search quarantines it as a failed certificate, never
    "uncertified", and the run goes on from step 3; the gate refuses it alike, with the run's spec or without."""
    from relay.preflight.admission import admit
    from relay.runs.run import Run
    from relay.spec.run_spec import load_spec

    spec, run = trained["spec"], run_at_six(trained, tmp_path)
    recorded = [e.get("certificate") for e in events(run, "checkpoint")]
    assert len(recorded) == 2 and all(r and len(r) == 64 for r in recorded), "each commit names its certificate"
    swap_rows(layout.step_dir(run, 6))
    (layout.step_dir(run, 6) / certificate.NAME).unlink()
    gated = shutil.copytree(run, tmp_path / "gated")

    resumed = relay_cli("train", str(spec), "--to-step", "7", "--checkpoint-dir", str(run))
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-3000:]
    assert "quarantined checkpoint step 6: certificate failed: global_step_6: its certificate was removed" in out
    assert "certified resume from step 3" in out and "uncertified" not in out, out[-3000:]
    assert [e["step"] for e in events(run, "fallback")] == [3]
    assert not layout.step_dir(run, 6).exists() or certificate.read(layout.step_dir(run, 6)).step == 6

    # without the run's spec too: `relay checkpoint validate` holds the step to its commit record
    for args in ((), ("--quick",)):
        plain = relay_cli("checkpoint", "validate", str(gated), "--step", "6", *args)
        assert plain.returncode == 1 and "its certificate was removed" in plain.stdout, plain.stdout + plain.stderr
    bad = admit(Run(load_spec(spec), "t", gated, None), 6)
    assert not bad.ok and bad.report.failed.name == "certificate", bad.explain()
    assert "its certificate was removed" in bad.report.failed.detail


def test_a_step_committed_without_a_certificate_resumes_uncertified_unless_one_is_required(trained, tmp_path):
    """Its commit recorded why it has none (the trainer could not compute it): the resume goes on uncertified and
    says why; `checkpoints.require_certificate: true` refuses it and falls back."""
    from relay.checkpoints import commits

    run = run_at_six(trained, tmp_path)
    six = layout.step_dir(run, 6)
    (six / certificate.NAME).unlink()
    (six / "relay_manifest.json").unlink(missing_ok=True)
    commits.write(run, 6, six, skipped="RuntimeError: a worker was lost computing it", by="the trainer's commit")

    strict = write_spec(
        tmp_path / "strict", **{"s3": DELETE, "trainer.settings.save_freq": 3, "checkpoints.require_certificate": True}
    )
    copy = shutil.copytree(run, tmp_path / "r")
    required = relay_cli("train", str(strict), "--to-step", "7", "--checkpoint-dir", str(copy))
    assert required.returncode != 0 and "checkpoints.require_certificate is on" in required.stdout + required.stderr

    resumed = train(trained["spec"], run, 7)
    assert "uncertified resume from step 6" in resumed.stdout and "a worker was lost" in resumed.stdout, resumed.stdout
    assert [e.get("certificate") for e in events(run, "chunk_start")][-1] == "uncertified"


def test_the_gate_loads_the_model_and_checks_its_certificate_offline(trained, tmp_path):
    from relay.preflight.admission import admit
    from relay.runs.run import Run
    from relay.spec.run_spec import load_spec

    run_dir = run_at_six(trained, tmp_path)
    run = Run(load_spec(trained["spec"]), "t", run_dir, None)
    good = admit(run, 3)
    assert good.ok and "certificate" in good.manifest.checks, good.explain()
    assert "✔ certificate: the model loaded offline reproduces its certificate" in good.report.summary()

    key = swap_rows(layout.step_dir(run_dir, 6))
    bad = admit(run, 6)
    assert not bad.ok and bad.report.failed.name == "certificate", bad.explain()
    assert key in bad.report.failed.detail and bad.fell_back_to == 3


def test_a_hugging_face_export_is_published_only_if_it_reproduces_the_certificate(trained, tmp_path):
    from safetensors.torch import load_file, save_file

    from relay.checkpoints.gate import admit_dir
    from relay.common.errors import CertificateError
    from relay.s3.publication import export_hf, verify_export

    run_dir = run_at_six(trained, tmp_path)
    step_dir = layout.step_dir(run_dir, 6)
    assert admit_dir(run_dir, 6).ok  # verl's merger reads only files the gate has proven
    export = export_hf(run_dir, 6)
    verified = verify_export(export, step_dir, 0.02)
    assert "reproduces the certificate of global_step_6: 27 tensors are the checkpoint's, cast to torch.bfloat16" in verified

    [weights] = export.glob("*.safetensors")
    tensors = load_file(weights)
    key = next(k for k in tensors if k.endswith("input_layernorm.weight"))
    tensors[key] = tensors[key].flip(0).contiguous()  # the same values, in another order
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CertificateError) as refused:
        verify_export(export, step_dir, 0.02)
    assert f"exported tensors that are not the checkpoint's: {key}" in refused.value.what
    assert "was not published" in refused.value.fix
