"""What a resume would load, read without a trainer (`python -m relay checkpoint inspect`).

The field guides tell users to start a debug run just to see which step, epoch and dataloader
offset a resume would load. Everything is in the checkpoint already: data.pt holds the
StatefulDataLoader's position, extra_state the LR scheduler and RNG states, the optimizer shard its
step count, the manifest (or the model shard) the parameters. Files are read with Relay's safe
loader only (weights_only, mmap), so inspecting an untrusted checkpoint runs nothing in it.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from relay.checkpoints import certificate, manifest, safeload
from relay.checkpoints.manifest import Manifest
from relay.checkpoints.validate import validate_checkpoint
from relay.common.errors import CheckpointError, StoreError
from relay.runs import layout
from relay.runs.record import read_record

RNG_NAMES = {"cpu": "cpu", "cuda": "cuda", "numpy": "numpy", "random": "python"}
MAX_OPTIM_DOWNLOAD = 512 << 20  # an S3 optimizer shard above this is not fetched just to count steps


class PublishedStore(Protocol):
    """What inspecting a published checkpoint asks of the store (relay.s3.store.CheckpointStore, a layer above)."""

    @property
    def uri(self) -> str: ...
    def run_key(self, run: str, *parts: str) -> str: ...
    def step_key(self, run: str, step: int, rel: str = "") -> str: ...
    def step_uri(self, run: str, step: int) -> str: ...
    def get_json(self, key: str) -> dict[str, Any] | None: ...
    def latest(self, run: str) -> dict[str, Any] | None: ...
    def manifest(self, run: str, step: int) -> Manifest | None: ...
    def verify(self, run: str, m: Manifest) -> None: ...
    def download_object(self, key_or_uri: str, dest: Path, expect: dict[str, Any] | None = None) -> None: ...


@dataclass
class ResumePreview:
    source: str
    step: int
    epoch: int | None = None  # 0-based epoch of the last trained step
    batches_in_epoch: int | None = None  # batches the dataloader has yielded in that epoch
    samples_in_epoch: int | None = None
    samples_per_epoch: int | None = None  # the (frozen) training set's rows
    optimizer_steps: int | None = None
    scheduler_steps: int | None = None
    lr_now: float | None = None  # the LR of the last trained step
    lr_next: float | None = None  # the LR the next step starts with
    rng: list[str] = field(default_factory=list)
    world_size: int | None = None
    fsdp_version: int | None = None
    parameters: int | None = None
    dtypes: list[str] = field(default_factory=list)
    files: dict[str, int] = field(default_factory=dict)  # relative path -> bytes
    checksums: str = "not checked"
    checksums_ok: bool | None = None  # None: nothing to compare with (no manifest yet)
    certificate: str | None = None  # the certificate's summary (relay.checkpoints.certificate), or why there is none
    notes: list[str] = field(default_factory=list)

    def position(self) -> str:
        if self.batches_in_epoch is None:
            return "dataloader position unknown (no data.pt)"
        of = f" of {self.samples_per_epoch}" if self.samples_per_epoch else ""
        return (
            f"epoch {self.epoch if self.epoch is not None else '?'}, dataloader at {self.samples_in_epoch}"
            f"{of} samples ({self.batches_in_epoch} batches) into the epoch"
        )

    def one_line(self) -> str:
        lr = f", lr next {self.lr_next:.4g}" if self.lr_next is not None else ""
        return f"resumes from step {self.step}: {self.position()}{lr}; {self.source}"

    def summary(self) -> str:
        def fmt(v: object) -> str:
            return "unknown" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v))

        total = sum(self.files.values())
        lines = [
            f"checkpoint {self.source}",
            f"  global step      {self.step}",
            f"  position         {self.position()}",
            f"  optimizer        {fmt(self.optimizer_steps)} optimizer steps; scheduler at {fmt(self.scheduler_steps)}",
            f"  learning rate    now {fmt(self.lr_now)}, next step {fmt(self.lr_next)}",
            f"  rng states       {', '.join(self.rng) or 'none'}",
            f"  parallelism      world size {fmt(self.world_size)}, FSDP{fmt(self.fsdp_version)}",
            f"  parameters       {fmt(self.parameters)} ({', '.join(self.dtypes) or 'dtype unknown'})",
            f"  files            {len(self.files)} files, {total} bytes",
        ]
        lines += [f"    {size:>14}  {rel}" for rel, size in sorted(self.files.items())]
        lines.append(f"  checksums        {self.checksums}")
        if self.certificate is not None:
            lines.append(f"  certificate      {self.certificate}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------ reading


def _read_state(preview: ResumePreview, step_dir: Path, world_size: int | None) -> None:
    """Dataloader, scheduler, RNG and optimizer state of a checkpoint folder (safe loader only)."""

    data_pt = step_dir / "data.pt"
    if data_pt.is_file():
        d = safeload.load(data_pt, mmap=False)
        preview.batches_in_epoch = int(d.get("_num_yielded", 0))
        sampler = d.get("_sampler_iter_state") or {}
        preview.samples_in_epoch = int(sampler.get("samples_yielded", 0)) if isinstance(sampler, dict) else None
    ws = world_size or 1
    extra = step_dir / "actor" / layout.shard_name("extra_state", ws, 0)
    if extra.is_file():
        e = safeload.load(extra, mmap=False)
        sched = e.get("lr_scheduler") or {}
        if sched.get("_last_lr"):
            preview.lr_next = float(sched["_last_lr"][0])
        if "last_epoch" in sched:
            preview.scheduler_steps = int(sched["last_epoch"])
        preview.rng = sorted(RNG_NAMES.get(k, k) for k in (e.get("rng") or {}))
    optim = step_dir / "actor" / layout.shard_name("optim", ws, 0)
    if optim.is_file():
        o = safeload.load(optim, mmap=True)
        states = (o.get("optimizer", o) if isinstance(o, dict) else {}).get("state", {})
        steps: list[Any] = [v.get("step") for v in states.values() if isinstance(v, dict) and "step" in v]
        if steps:
            s = steps[0]
            preview.optimizer_steps = int(s.item() if hasattr(s, "item") else s)


def _params_of(preview: ResumePreview, m: Manifest | None, step_dir: Path) -> None:
    if m is not None and m.params:
        params = m.params
    else:
        from relay.checkpoints import safeload
        from relay.checkpoints.validate import _global_shape

        shard = step_dir / "actor" / layout.shard_name("model", preview.world_size or 1, 0)
        if not shard.is_file():
            return
        state = safeload.load(shard, mmap=True)
        params = {k: _global_shape(v) for k, v in state.items() if hasattr(v, "dtype")}
    preview.parameters = sum(math.prod(int(x) for x in v[:-1]) for v in params.values())
    preview.dtypes = sorted({str(v[-1]).removeprefix("torch.") for v in params.values()})


def _run_context(preview: ResumePreview, record: dict[str, Any], metrics: list[dict[str, Any]] | None) -> None:
    """What the checkpoint does not hold: the training set's size, steps per epoch, the LR used."""
    files = (record.get("data") or {}).get("files") or []
    rows = sum(f["rows"] for f in files if f.get("role") == "train") or None
    preview.samples_per_epoch = rows
    values = (record.get("settings") or {}).get("values") or {}
    spe = values.get("resolved.steps_per_epoch")
    if spe:
        # The epoch of the last consumed batch, as the trainer counts it on resume.
        preview.epoch = (preview.step - 1) // spe if preview.step else 0
    elif preview.batches_in_epoch is not None and preview.step:
        preview.notes.append("epoch unknown: the run record has no steps per epoch")
    for row in metrics or []:
        if row.get("step") == preview.step and "lr" in row:
            preview.lr_now = float(row["lr"])


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def inspect_dir(path: Path, step: int | None = None, *, verify: bool = True) -> ResumePreview:
    """Inspect a run folder (the tracker's step, or `step`) or a global_step_N folder.

    verify=True reads every byte (zip CRCs, and the manifest's CRC64NVME when there is one);
    verify=False reads only the small state files (a chunk's log preview).
    """

    path = Path(path)
    if match := layout.STEP_DIR.match(path.name):
        run_dir, step = path.parent, int(match.group(1))
    else:
        run_dir = path
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir} is not a folder", "give a run folder, a global_step_N folder or an s3:// URI")
    report = validate_checkpoint(run_dir, step, upto="integrity" if verify else "consistency")
    if report.step is None or (report.failed and report.failed.name in ("structure", "consistency")):
        raise CheckpointError(
            f"nothing to inspect in {run_dir}: {report.failed.detail if report.failed else ''}",
            f"run `python -m relay checkpoint validate {run_dir}` for the whole report",
        )
    step_dir = layout.step_dir(run_dir, report.step)
    preview = ResumePreview(str(step_dir), report.step, world_size=report.world_size, fsdp_version=report.fsdp_version)
    m = manifest.read(step_dir)
    if verify:
        preview.files = {rel: f["size"] for rel, f in report.files.items()}
        integrity = next((c for c in report.checks if c.name == "integrity"), None)
        if integrity is None or not integrity.ok:
            failed = integrity or report.failed
            assert failed is not None  # no passing integrity check: it failed, or an earlier check did
            preview.checksums, preview.checksums_ok = failed.detail, False
        elif m is None:
            preview.checksums = f"{integrity.detail}; no manifest yet (the gate has not admitted it)"
        else:
            preview.checksums, preview.checksums_ok = integrity.detail, True
    else:
        preview.files = {rel: (step_dir / rel).stat().st_size for rel in manifest.checkpoint_files(step_dir)}
    _read_state(preview, step_dir, report.world_size)
    cert = certificate.read(step_dir)
    preview.certificate = (
        cert.summary() if cert else "none: resumes uncertified (saved before certificates, or without Relay)"
    )
    _params_of(preview, m, step_dir)
    _run_context(preview, read_record(run_dir), _metrics(run_dir))
    return preview


def inspect_uri(store: PublishedStore, run: str, step: int | None = None) -> ResumePreview:
    """Inspect a published checkpoint: the manifest, the objects' checksums (HEAD), and the small
    state files downloaded to a temporary folder. The run's published record adds its data size."""

    if step is None:
        latest = store.latest(run)
        if latest is None:
            raise StoreError(
                f"no published checkpoint of run {run} under {store.uri}",
                "check the URI; `python -m relay checkpoint ls` lists runs and steps",
            )
        step = latest["step"]
    m = store.manifest(run, step)
    if m is None:
        raise StoreError(
            f"{store.step_uri(run, step)} has no manifest: it is not a published checkpoint",
            "`python -m relay checkpoint ls` lists the published steps",
        )
    preview = ResumePreview(
        store.step_uri(run, step),
        step,
        world_size=m.world_size,
        fsdp_version=m.fsdp_version,
        files={rel: f["size"] for rel, f in m.files.items()},
    )
    try:
        store.verify(run, m)
        preview.checksums, preview.checksums_ok = f"{len(m.files)} objects match the manifest's sizes and CRC64NVME", True
    except StoreError as e:
        preview.checksums, preview.checksums_ok = e.what, False
    optim = f"actor/{layout.shard_name('optim', m.world_size, 0)}"
    wanted = ["data.pt", f"actor/{layout.shard_name('extra_state', m.world_size, 0)}"]
    if m.files.get(optim, {}).get("size", 0) <= MAX_OPTIM_DOWNLOAD:
        wanted.append(optim)
    else:
        preview.notes.append(
            f"optimizer steps not read: {optim} is {m.files[optim]['size']} bytes; inspect a restored copy for them"
        )
    with tempfile.TemporaryDirectory(prefix="relay-inspect-") as tmp:
        for rel in (r for r in wanted if r in m.files):
            store.download_object(store.step_key(run, step, rel), Path(tmp) / rel, m.files[rel])
        _read_state(preview, Path(tmp), m.world_size)
    _params_of(preview, m, Path())
    record = store.get_json(store.run_key(run, "run.json")) or {}
    _run_context(preview, record, None)
    if preview.lr_now is None:
        preview.notes.append("LR now: metrics.jsonl is not published; the next step's LR is exact")
    return preview
