"""A chunk's validated checkpoint published to S3, as its publish task does it: once (an earlier DAG run's
publication is recognised by its manifest), or nothing where the run trained past the chunk's end without saving
there (`relay train` across chunks: the later chunk's checkpoint is the one to publish)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.checkpoints import manifest, safeload
from relay.runs import layout
from relay.runs.run import Run
from relay.s3.publication import Publication, publish_checkpoint
from relay.s3.store import CheckpointStore
from relay.spec.plan import Chunk


@dataclass(frozen=True)
class Published:
    """What the publish step did: `already` published, `skipped` (no checkpoint at the step), or `published`
    (with the publication: its URIs, files, retention)."""

    how: str
    step: int
    uri: str = ""
    publication: Publication | None = None
    result: dict[str, Any] = field(default_factory=dict)  # the task's return value

    def describe(self) -> str:
        """What it did, in a log's words."""
        if self.how == "already":
            return f"already published to {self.uri}"
        if self.how == "skipped":
            return f"no checkpoint at step {self.step} and none published; nothing to publish"
        pub = self.publication
        assert pub is not None
        line = (
            f"published {pub.uri} ({pub.uploaded} files uploaded, {pub.skipped} already there, "
            f"{pub.bytes_uploaded} bytes in {pub.seconds:.1f}s)"
        )
        if pub.hf_uri:
            line += f"; Hugging Face model at {pub.hf_uri}"
        if pub.deleted_local or pub.published_retention.get("deleted"):
            line += (
                f"; retention deleted local steps {pub.deleted_local}, published steps "
                f"{pub.published_retention.get('deleted')}"
            )
        return line


def already_published(run: Run, step: int, store: CheckpointStore) -> bool:
    """Published by an earlier DAG run: S3's manifest is the local one (or the local copy was pruned)."""
    published = store.manifest(run.name, step)
    if published is None:
        return False
    local = manifest.read(layout.step_dir(run.dir, step))
    return local is None or local.files == published.files


def publish(run: Run, chunk: Chunk, store: CheckpointStore) -> Published:
    """Publish the chunk's end step (files, manifest, then latest; a Hugging Face export for milestones; retention),
    once."""
    step = chunk.end_step
    if already_published(run, step, store):
        uri = store.step_uri(run.name, step)
        return Published("already", step, uri, result={"step": step, "uri": uri, "already": True})
    if not layout.step_dir(run.dir, step).is_dir():
        return Published("skipped", step, result={"step": step, "skipped": True})
    pub = publish_checkpoint(run, step, store)
    return Published("published", step, pub.uri, pub, pub.to_dict())


def evaluate(store: CheckpointStore, manifest_uri: str) -> dict[str, Any]:
    """The example evaluation of a published checkpoint: its model's first shard downloaded (checked against the
    manifest) and loaded through the safe loader; its run, step and the parameters it holds."""
    m = store.manifest_at(manifest_uri)
    shard = layout.shard_name("model", m.world_size, 0)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / shard
        store.download_object(f"{manifest_uri.rsplit('/', 1)[0]}/actor/{shard}", local, m.files[f"actor/{shard}"])
        state = safeload.load(local, mmap=False)
    params = sum(int(v.numel()) for v in state.values() if hasattr(v, "numel"))
    return {"run": m.run, "step": m.step, "parameters_in_shard_0": params, "tensors": len(state)}
