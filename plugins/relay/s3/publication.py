"""Publishing a chunk's validated checkpoint: S3 (files, manifest, latest), a Hugging Face model for
milestones and the final step (verl's model merger, verified against the checkpoint's certificate before it is
uploaded), then retention, locally and in S3."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay.checkpoints import certificate, manifest, retention, shards
from relay.checkpoints.manifest import unchanged_since_validation
from relay.common.errors import CertificateError, CheckpointError
from relay.runs import layout
from relay.runs.run import Run
from relay.s3 import history
from relay.s3.store import CheckpointStore

HF_DIR = layout.HF_DIR


@dataclass
class Publication:
    run: str
    step: int
    uri: str
    manifest_uri: str
    uploaded: int
    skipped: int
    bytes_uploaded: int
    seconds: float
    latest_moved: bool
    hf_uri: str | None = None
    hf_verified: str | None = None  # what the export's check against the certificate found
    deleted_local: list[int] = field(default_factory=list)
    published_retention: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def export_hf(run_dir: Path, step: int) -> Path:
    """Merge the checkpoint's actor shards into a Hugging Face model with verl's model merger.

    Runs only on a checkpoint that passed validation: the merger loads shards with
    torch.load(weights_only=False), and the gate has just proven these files hold nothing unsafe.
    """
    src = layout.step_dir(run_dir, step) / "actor"
    dest = Path(run_dir) / HF_DIR / layout.step_name(step)
    if (dest / "config.json").is_file() and any(dest.glob("*.safetensors")):
        return dest
    unchanged_since_validation(layout.step_dir(run_dir, step), "actor/")
    cmd = [
        sys.executable,
        "-m",
        "verl.model_merger",
        "merge",
        "--backend",
        "fsdp",
        "--local_dir",
        str(src),
        "--target_dir",
        str(dest),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if r.returncode != 0:
        raise CheckpointError(
            f"verl's model merger failed on {src}: {r.stderr.strip().splitlines()[-1:]}",
            f"run `{' '.join(cmd)}` to see the whole error",
        )
    return dest


def publish_folder(store: CheckpointStore, folder: Path, key_prefix: str) -> str:
    """Upload a plain folder (the HF model) with checksums; skip files already there and equal."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        store.put_file(f"{key_prefix}/{path.relative_to(folder)}", path)
    return f"s3://{store.bucket}/{key_prefix}/"


def verify_export(folder: Path, step_dir: Path, tolerance: float) -> str:
    """The Hugging Face export, loaded with transformers, against the checkpoint and its certificate. At any world
    size, tensor by tensor: every exported tensor is the checkpoint's cast to the export's dtype (its digest, from the
    shards' pieces at their global offsets: relay.checkpoints.shards), none is missing, and the checkpoint's own
    tensors are the certified ones. The probe, where there is a certificate: the export's probe equals, within
    `tolerance`, the probe of the checkpoint's weights (its pieces put together, at any world size) cast alike in the
    architecture of its huggingface/ folder (so the export's config and code read the weights as the trainer did; a
    comparison with the certified log-probs themselves would measure the dtype's rounding, which grows as a model
    sharpens). A checkpoint without a certificate is verified against its own weights, tensor by tensor.
    CertificateError otherwise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    saved = certificate.read(step_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").to(torch.device("cpu"))
    exported = dict(certificate.named_state(model))
    dtype = next(iter(exported.values())).dtype
    model_shards = shards.read(step_dir)
    pieces = model_shards.pieces
    problems: list[str] = []
    if saved is not None:
        ours = model_shards.digests(saved.params)
        if changed := sorted(n for n in saved.params if ours.get(n) != saved.params[n]):
            problems.append(f"the checkpoint's own tensors are not those certified: {', '.join(changed[:5])}")
    tied = getattr(model.config, "tie_word_embeddings", False)
    wanted = set(saved.params) if saved is not None else {n for n in pieces if not (tied and n == "lm_head.weight")}
    missing = sorted(n for n in pieces if n in wanted and n not in exported)
    cast = shards.summed_digests({n: [(t.to(exported[n].dtype), o) for t, o in pieces[n]] for n in pieces if n in exported})
    theirs = certificate.digests((n, exported[n]) for n in cast)
    differ = sorted(n for n, d in cast.items() if d != theirs[n])
    if missing:
        problems.append(f"tensors missing from the export: {', '.join(missing[:5])}")
    if differ:
        problems.append(f"exported tensors that are not the checkpoint's: {', '.join(differ[:5])}")
    checked = f"{len(cast)} tensors are the checkpoint's, cast to {dtype}"
    largest, against = 0.0, ""
    if saved is not None:
        logprobs = certificate.probe_logprobs(model, saved.probe_ids, saved.pad_id)
        reference, against = saved.logprobs, "the certificate's"
        if not problems:  # the checkpoint's whole tensors, from its pieces at any world size
            config = AutoConfig.from_pretrained(step_dir / "actor" / "huggingface")
            ref = AutoModelForCausalLM.from_config(
                config, dtype=dtype, attn_implementation=model.config._attn_implementation
            )
            weights = model_shards.full(dtype)
            if getattr(config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in weights:
                weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"])
            ref.load_state_dict(weights, strict=True)
            reference = certificate.probe_logprobs(ref, saved.probe_ids, saved.pad_id)
            against = "the checkpoint's weights' (cast alike)"
        diffs = [abs(a - b) for xs, ys in zip(reference, logprobs, strict=True) for a, b in zip(xs, ys, strict=True)]
        largest = max(diffs, default=0.0)
        if not largest <= tolerance:  # NaN too
            problems.append(f"the probe's log-probs differ from {against} by up to {largest:.3g} (> {tolerance:g})")
    if problems:
        of = f"the certificate of {step_dir.name}" if saved is not None else f"the weights of {step_dir.name}"
        raise CertificateError(
            f"the Hugging Face export {folder} does not reproduce {of}: " + "; ".join(problems),
            f"it was not published. Remove {folder} and publish the step again: the export is made anew from the "
            "checkpoint, which passed the gate",
        )
    if saved is None:
        return f"reproduces the weights of {step_dir.name}: {checked} (it has no certificate: no probe compared)"
    return f"reproduces the certificate of {step_dir.name}: {checked}; probe log-probs within {largest:.3g} of {against}"


def publish_checkpoint(run: Run, step: int, store: CheckpointStore) -> Publication:
    spec, run_dir = run.spec, run.dir
    t0 = time.time()
    # An old DAG run's publish task, queued across a fresh start, publishes nothing of the new incarnation.
    run.folder.lease().fence(f"publishing step {step}")
    if spec.checkpoints.certificate_before_publish:
        _require_offline_certificate(run, step)
    r = store.publish(run.folder, step)
    history.publish(store, run.folder)  # restored with the checkpoint on a host that lost the folder
    pub = Publication(
        run.name,
        step,
        r.uri,
        f"{r.uri}relay_manifest.json",
        len(r.uploaded),
        len(r.skipped),
        r.bytes_uploaded,
        round(r.seconds, 3),
        r.latest_moved,
    )
    policy = spec.checkpoints
    if policy.hf_export and policy.is_milestone(step, spec.total_steps):
        hf_key = store.run_key(run.name, HF_DIR, layout.step_name(step))
        export = export_hf(run_dir, step)
        pub.hf_verified = verify_export(export, layout.step_dir(run_dir, step), policy.offline_tolerance)
        pub.hf_uri = publish_folder(store, export, hf_key)
    run.folder.record(
        "publish",
        step=step,
        uri=r.uri,
        uploaded=pub.uploaded,
        skipped=pub.skipped,
        hf_uri=pub.hf_uri,
        hf_verified=pub.hf_verified,
        seconds=round(time.time() - t0, 3),
    )  # the upload and export: the goodput ledger
    published = {m.step for m in store.published(run.name)}
    pub.deleted_local = retention.apply_local(run_dir, policy, spec.total_steps, published, incarnation=run.incarnation)
    pub.published_retention = retention.apply_published(
        store, run.name, policy, spec.total_steps, run_dir=run_dir, incarnation=run.incarnation
    )
    return pub


def _require_offline_certificate(run: Run, step: int) -> None:
    """checkpoints.certificate_before_publish: the gate's manifest must record the certificate level as run."""
    m = manifest.read(layout.step_dir(run.dir, step))
    if m is None or "certificate" not in m.checks:
        why = (m.skipped.get("certificate") if m is not None else None) or "the gate has not admitted it"
        raise CertificateError(
            f"step {step} of run {run.name} is not published: checkpoints.certificate_before_publish asks for the "
            f"gate's offline certificate check, which did not run ({why})",
            "the checkpoint is kept and the run goes on from it; turn checkpoints.certificate_before_publish off to "
            "publish checkpoints the gate cannot certify, or train with a trainer that writes certificates",
        )
