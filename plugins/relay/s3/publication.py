"""Publishing a chunk's validated checkpoint: S3 (files, manifest, latest), a Hugging Face model for
milestones and the final step (verl's model merger), then retention, locally and in S3."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay.checkpoints import retention
from relay.checkpoints.manifest import unchanged_since_validation
from relay.common.errors import CheckpointError
from relay.runs import layout
from relay.runs.metrics import record_event
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


def publish_checkpoint(run: Run, step: int, store: CheckpointStore) -> Publication:
    spec, run_dir = run.spec, run.dir
    t0 = time.time()
    r = store.publish(run.name, run_dir, step)
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
        pub.hf_uri = publish_folder(store, export_hf(run_dir, step), hf_key)
    record_event(
        run_dir,
        "publish",
        step=step,
        uri=r.uri,
        uploaded=pub.uploaded,
        skipped=pub.skipped,
        hf_uri=pub.hf_uri,
        seconds=round(time.time() - t0, 3),
    )  # the upload and export: the goodput ledger
    published = {m.step for m in store.published(run.name)}
    pub.deleted_local = retention.apply_local(run_dir, policy, spec.total_steps, published)
    pub.published_retention = retention.apply_published(store, run.name, policy, spec.total_steps, run_dir=run_dir)
    return pub
