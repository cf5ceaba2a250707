"""Checkpoint validation in named levels, producing a structured CheckReport.

No checkpoint is resumed from, published or called latest until it has been proven whole:

- structure: the tracker parses; global_step_N exists and is not a rotation leftover; every file
  the layout requires is present and non-empty for the world size that the shard names and
  fsdp_config.json record (model, optim, extra_state per rank; data.pt; huggingface/config.json;
  critic/ when the algorithm has one).
- consistency: the tracker, the folder name and the expected chunk end agree; the world size is
  the one of the run's earlier checkpoints; the step's commit record (relay.checkpoints.commits) does not refuse
  the certificate its folder holds now (one removed or replaced since the commit fails as a certificate does, at
  every level and with or without the run's spec).
- integrity: every .pt passes its zip CRC32; when a manifest exists, every file still has the
  size and CRC64NVME it recorded (so a file cannot change between validation and use).
- loadability: every .pt loads through the safe loader (weights_only, mmap); every pickle of verl's TransferQueue
  state (transfer_queue/) through a restricted unpickler (relay.checkpoints.queue_pickles).
- numerics: model and optimizer tensors are finite; parameter names and shapes match the run's
  previous valid checkpoint.
- smoke (optional): a trainer-provided forward pass on a fixed prompt gives finite logits. A smoke check that
  cannot run here (a checkpoint too large, a world size it does not load) raises Skipped: the level is
  recorded as skipped, with why, never as passed; the manifest lists the levels that ran apart from those
  skipped.
- certificate (optional): the checkpoint's model, loaded offline, reproduces its certificate (the parameters'
  digests exactly, the probe's log-probs within the tolerance; relay.checkpoints.certificate). Skipped, saying
  why, for a checkpoint without one or a trainer without an offline check; the trainer checks it at resume.

Each file is mapped, not copied: its checksums (every core, segment by segment) and its loading read the
same page-cache pages; two files are loaded at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relay.checkpoints import commits, integrity, manifest, queue_pickles, safeload
from relay.checkpoints.reshard_record import record_of
from relay.checkpoints.safeload import is_sharded_record
from relay.common.errors import CheckpointError
from relay.runs import layout
from relay.runs.record import LEGACY_INCARNATION, folder_incarnation

LEVELS = ("structure", "consistency", "integrity", "loadability", "numerics", "smoke", "certificate")


class Skipped(Exception):
    """A level that did not run here, and why (a smoke check's checkpoint too large to load on this host)."""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    skipped: bool = False  # did not run (ok, so the checkpoint is not refused for it; never shown as passed)


@dataclass
class CheckReport:
    run_dir: str
    step: int | None
    checks: list[Check] = field(default_factory=list)
    world_size: int | None = None
    fsdp_version: int | None = None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    params: dict[str, list[int | str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failed(self) -> Check | None:
        return next((c for c in self.checks if not c.ok), None)

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, ok, detail))
        return ok

    @property
    def ran(self) -> list[str]:
        """The levels that ran (passed or failed), in order."""
        return [c.name for c in self.checks if not c.skipped]

    @property
    def skipped(self) -> dict[str, str]:
        """{level: why} of the levels that did not run."""
        return {c.name: c.detail for c in self.checks if c.skipped}

    @property
    def path(self) -> str:
        return str(layout.step_dir(Path(self.run_dir), self.step)) if self.step is not None else self.run_dir

    def summary(self) -> str:
        head = f"checkpoint {self.path}: {'VALID' if self.ok else 'INVALID'}"
        marks = [
            f"  {'-' if c.skipped else '✔' if c.ok else '✘'} {c.name}: {'skipped: ' if c.skipped else ''}{c.detail}"
            for c in self.checks
        ]
        return "\n".join([head, *marks])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("files")
        d.pop("params")
        return dict(d, ok=self.ok, path=self.path)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def validate_checkpoint(
    run_dir: Path,
    step: int | None = None,
    *,
    expected_step: int | None = None,
    upto: str = "numerics",
    expect_critic: bool | None = None,
    smoke: Callable[[Path], str] | None = None,
    certify: Callable[[Path], str] | None = None,
    checked: dict[str, FileResult] | None = None,
) -> CheckReport:
    """Validate global_step_<step> of a run (default: the step the tracker names), level by level up
    to `upto` (then smoke, if given). upto="consistency" reads no file: cheap enough for a
    scheduler-side "is this chunk done?" question; "integrity" reads every byte but unpickles nothing.
    checked: files already put through check_file (by a restore, as each arrived), by relative path; they
    are not read again.
    """
    depth = LEVELS.index(upto)
    run_dir = Path(run_dir)
    report = CheckReport(str(run_dir), step)
    try:
        tracker = layout.read_tracker(run_dir)
    except CheckpointError as e:
        tracker = None
        if step is None:
            report.add("structure", False, e.what)
            return report
    if step is None:
        if tracker is None:
            report.add("structure", False, f"no tracker ({layout.TRACKER}) in {run_dir}")
            return report
        step = report.step = tracker
    ckpt = layout.step_dir(run_dir, step)
    if not _structure(report, ckpt, expect_critic):
        return report
    if not _consistency(report, run_dir, step, tracker, expected_step):
        return report
    if (standing := commits.standing(run_dir, step, ckpt)).kind == "refused":
        # what the commit recorded binds the step, with or without a spec: a certificate removed to get past it fails
        report.add("certificate", False, f"{layout.step_name(step)}: {standing.detail}")
        return report
    if depth <= LEVELS.index("consistency"):
        return report
    load = depth >= LEVELS.index("loadability")
    if not _integrity_and_loading(report, ckpt, load, checked or {}):
        return report
    if depth >= LEVELS.index("numerics") and not _compare_with_previous(report, run_dir, step):
        return report
    # a failed forward pass, whatever it raised, makes the checkpoint invalid; a certificate fails on what it says
    if smoke is not None and not _trainer_level(
        report, "smoke", smoke, ckpt, Exception, lambda e: f"forward pass failed: {e}"
    ):
        return report
    if certify is not None:
        _trainer_level(report, "certificate", certify, ckpt, CheckpointError, lambda e: e.what)
    return report


def _trainer_level(
    report: CheckReport,
    name: str,
    check: Callable[[Path], str],
    ckpt: Path,
    fails: type[Exception],
    detail: Callable[[Any], str],
) -> bool:
    """A level the trainer provides: passed (its detail), skipped (Skipped: why, never counted as passed), or failed
    (an exception of class `fails`, said by `detail`)."""
    try:
        return report.add(name, True, check(ckpt))
    except Skipped as why:
        report.checks.append(Check(name, True, str(why), skipped=True))
        return True
    except fails as e:
        return report.add(name, False, detail(e))


# --------------------------------------------------------------------------------- structure


def _structure(report: CheckReport, ckpt: Path, expect_critic: bool | None) -> bool:
    if not ckpt.is_dir():
        return report.add("structure", False, f"{ckpt.name} does not exist")
    if layout.is_rotation_leftover(ckpt):
        return report.add("structure", False, f"{ckpt.name} is a rotation leftover (no actor/), not a checkpoint")
    missing: list[str] = []
    for role in layout.ROLES:
        role_dir = ckpt / role
        if role == "critic" and not role_dir.exists():
            if expect_critic:
                missing.append("critic/ (the algorithm has a critic)")
            continue
        try:
            cfg = layout.read_fsdp_config(role_dir)
        except CheckpointError as e:
            return report.add("structure", False, e.what)
        if cfg is None:
            missing.append(f"{role}/fsdp_config.json")
            continue
        ws = int(cfg.get("world_size", 0))
        if role == "actor":
            report.world_size, report.fsdp_version = ws, cfg.get("FSDP_version")
        named = {int(m.group(2)) for p in role_dir.iterdir() if (m := layout.SHARD.match(p.name))}
        if named - {ws}:
            return report.add(
                "structure", False, f"{role}/ shards name world size {sorted(named)}, fsdp_config.json records {ws}"
            )
        for rank in range(ws):
            for kind in layout.SHARD_KINDS:
                f = role_dir / layout.shard_name(kind, ws, rank)
                if not f.is_file() or f.stat().st_size == 0:
                    missing.append(f"{role}/{f.name}" + (" (empty)" if f.is_file() else ""))
        hf = role_dir / "huggingface" / "config.json"
        if not hf.is_file() or hf.stat().st_size == 0:
            missing.append(f"{role}/huggingface/config.json")
    data = ckpt / "data.pt"
    if not data.is_file() or data.stat().st_size == 0:
        missing.append("data.pt" + (" (empty)" if data.is_file() else ""))
    if missing:
        return report.add("structure", False, f"{ckpt.name} is missing: {', '.join(missing)}")
    return report.add("structure", True, f"complete for world size {report.world_size} (FSDP{report.fsdp_version})")


# ------------------------------------------------------------------------------- consistency


def earlier_world_size(run_dir: Path, step: int) -> tuple[int, int] | None:
    """(step, world size) of the run's newest earlier checkpoint, from its manifest or fsdp_config.json."""
    for s, path in sorted(layout.step_dirs(run_dir).items(), reverse=True):
        if s >= step or layout.is_rotation_leftover(path):
            continue
        try:
            m = manifest.read(path)
            if m is not None:
                return s, m.world_size
            cfg = layout.read_fsdp_config(path / "actor")
        except CheckpointError:
            continue
        if cfg:
            return s, int(cfg.get("world_size", 0))
    return None


def _consistency(report: CheckReport, run_dir: Path, step: int, tracker: int | None, expected_step: int | None) -> bool:
    if expected_step is not None and step != expected_step:
        return report.add("consistency", False, f"checkpoint step {step}, but the chunk ends at step {expected_step}")
    if expected_step is not None and tracker != expected_step:
        return report.add(
            "consistency", False, f"the tracker names step {tracker}, but the chunk's checkpoint is step {expected_step}"
        )
    earlier = earlier_world_size(run_dir, step)
    agree = f"tracker {tracker}, folder global_step_{step}" + (f", chunk end {expected_step}" if expected_step else "")
    if earlier and earlier[1] != report.world_size:
        # A world size changes only through `relay checkpoint reshard`, whose record names the one it came from.
        try:
            record = record_of(layout.step_dir(run_dir, step))
        except CheckpointError as e:
            return report.add("consistency", False, e.what)
        if record is None or record["world_size"] != earlier[1]:
            return report.add(
                "consistency",
                False,
                f"world size {report.world_size}, but the run's earlier checkpoint (step {earlier[0]}) "
                f"has world size {earlier[1]}: resuming would silently re-shard or fail",
            )
        return report.add("consistency", True, f"{agree}; resharded from world size {earlier[1]} (step {earlier[0]}'s)")
    return report.add("consistency", True, agree + (f"; world size as at step {earlier[0]}" if earlier else ""))


# ------------------------------------------------------- integrity, loadability and numerics


@dataclass
class FileResult:
    rel: str
    scan: integrity.FileScan
    load_error: str | None = None
    nonfinite: str | None = None
    params: dict[str, list[int | str]] | None = None
    loaded: bool = False  # checked at the loadability and numerics levels too (when it is a .pt file)
    queue_pickle: bool = False  # one of verl's TransferQueue pickles, read through the restricted unpickler


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, local tensor) pairs of a loaded object: DTensors' local parts, ShardedTensor shards."""
    import torch

    if is_sharded_record(obj):
        for i, shard in enumerate(obj.local_shards):
            yield f"{prefix}[shard {i}]", shard.tensor
    elif isinstance(obj, torch.Tensor):
        yield prefix, obj.to_local() if hasattr(obj, "to_local") else obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


def _global_shape(value: Any) -> list[int | str]:
    shape = value.global_shape if is_sharded_record(value) else tuple(value.shape)
    return [int(x) for x in shape] + [str(value.dtype).removeprefix("torch.")]


def check_file(ckpt: Path, rel: str, load: bool = True, pool: Executor | None = None) -> FileResult:
    """Integrity of one file of a checkpoint folder, and for a .pt file (with load) its loadability and numerics.
    pool: where the file's segments are checksummed in parallel (integrity.scan).

    A .pt file is loaded first, memory-mapped (its pickle is read, none of its tensors' bytes), so that the one
    pass of integrity.scan over the bytes also checks the floating-point values: each byte is read once for
    every level. A file that fails integrity is reported as such, even if it also fails to load."""
    import torch

    path = ckpt / rel
    if load and path.suffix != ".pt" and queue_pickles.is_queue_pickle(rel, _head(path)):
        return _check_queue_pickle(path, rel, pool)
    if path.suffix != ".pt" or not load:
        return FileResult(rel, integrity.scan(path, pool=pool), loaded=load)
    shard = bool(layout.SHARD.match(path.name)) and not path.name.startswith("extra_state")
    obj, load_error = None, None
    try:
        obj = safeload.load(path, mmap=True)
    except CheckpointError as e:
        load_error = e.what
    except Exception as e:  # noqa: BLE001 - damaged bytes can fail torch's reader in any way: integrity names them
        load_error = f"{path} cannot be loaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    floats = _float_entries(path, obj) if shard and obj is not None else None
    res = FileResult(rel, integrity.scan(path, pool=pool, finite=floats), loaded=load)
    if res.scan.problem:
        return res
    if load_error:
        res.load_error = load_error
        return res
    if shard and (floats is None or res.scan.nonfinite):
        # Tensor by tensor: it names the tensor, and ignores a storage's bytes outside every tensor (a storage can
        # hold more than its tensors view). Also when the storages could not be placed.
        for name, t in _tensors(obj):
            # A sum is NaN/Inf when any element is (one fast reduction, no mask); a sum that overflows
            # on finite values is told apart by the exact elementwise check.
            if (
                t.is_floating_point()
                and t.numel()
                and not bool(torch.isfinite(t.sum()))
                and not bool(torch.isfinite(t).all())
            ):
                res.nonfinite = f"{rel}: {name} holds NaN or Inf"
                break
    if path.name.startswith("model_world_size_") and path.name.endswith("_rank_0.pt") and isinstance(obj, dict):
        res.params = {k: _global_shape(v) for k, v in obj.items() if hasattr(v, "dtype")}
    return res


def _head(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(2)
    except OSError:
        return b""


def _check_queue_pickle(path: Path, rel: str, pool: Executor | None) -> FileResult:
    """One of verl's TransferQueue pickles: its bytes, then its restricted load (relay.checkpoints.queue_pickles)."""
    res = FileResult(rel, integrity.scan(path, pool=pool), loaded=True, queue_pickle=True)
    if not res.scan.problem:
        try:
            queue_pickles.load(path)
        except CheckpointError as e:
            res.load_error = e.what
    return res


def _float_entries(path: Path, obj: Any) -> dict[int, str] | None:
    """Where each floating-point storage of a memory-mapped load lies in the file (its zip entry's data offset)
    and its dtype's name, for integrity.scan's check of the values; None when they cannot all be placed.

    torch maps the whole file once and each storage is a slice of that map at its entry's offset, so the storages'
    addresses differ by the entries' offsets: the base is the one that puts every storage on an entry of its size.
    Every tensor is a view of its storage, in the storage's dtype, so all-finite storages are all-finite tensors."""
    storages: dict[int, tuple[int, str]] = {}
    for _, t in _tensors(obj):
        if t.is_floating_point() and t.numel():
            st = t.untyped_storage()
            if st.nbytes():
                storages[st.data_ptr()] = (st.nbytes(), str(t.dtype).removeprefix("torch."))
    if not storages:
        return {}
    try:
        sizes = {off: size for _, off, size, _ in integrity.zip_entries(path)}
    except Exception:  # noqa: BLE001 - not a readable zip: integrity.scan says why
        return None
    low = min(storages)
    for off, size in sizes.items():
        if size != storages[low][0]:
            continue
        placed = {ptr - (low - off): v for ptr, v in storages.items()}
        if all(sizes.get(o) == n and o % 64 == 0 for o, (n, _) in placed.items()):
            return {o: dtype for o, (_, dtype) in placed.items()}
    return None


def _integrity_and_loading(report: CheckReport, ckpt: Path, load: bool, checked: dict[str, FileResult]) -> bool:
    recorded = manifest.read(ckpt)
    rels = manifest.checkpoint_files(ckpt)
    # Two files at a time (their loading and numerics: torch, which releases the GIL), the checksums of every
    # file's segments on every core: a checkpoint is mostly one or two large files per rank.
    with ThreadPoolExecutor(os.cpu_count() or 2) as segments, ThreadPoolExecutor(2) as files:
        results = list(
            files.map(
                lambda r: checked[r]
                if r in checked and (checked[r].loaded or not load)
                else check_file(ckpt, r, load, segments),
                rels,
            )
        )
    report.files = {r.rel: {"size": r.scan.size, "crc64nvme": r.scan.crc64nvme} for r in results}
    bad = next((r for r in results if r.scan.problem), None)
    if bad:
        return report.add("integrity", False, f"{bad.rel}: {bad.scan.problem}")
    if recorded is not None:
        if set(recorded.files) != set(report.files):
            diff = sorted(set(recorded.files) ^ set(report.files))
            return report.add("integrity", False, f"files differ from the manifest: {', '.join(diff)}")
        changed = [rel for rel, f in report.files.items() if recorded.files[rel] != f]
        if changed:
            return report.add(
                "integrity",
                False,
                f"changed since validation (size or CRC64NVME differs from the manifest): {', '.join(changed)}",
            )
    total = sum(f["size"] for f in report.files.values())
    report.add(
        "integrity",
        True,
        f"{len(results)} files, {total} bytes: zip CRCs pass" + ("; checksums match the manifest" if recorded else ""),
    )
    if not load:
        return True
    load_error = next((r.load_error for r in results if r.load_error), None)
    if load_error:
        return report.add("loadability", False, load_error)
    n_pt = sum(1 for r in results if r.rel.endswith(".pt"))
    n_queue = sum(1 for r in results if r.queue_pickle)
    queue = f"; {n_queue} TransferQueue pickles through the restricted unpickler" if n_queue else ""
    report.add("loadability", True, f"{n_pt} .pt files load with weights_only (mmap){queue}, nothing unsafe")
    nonfinite = next((r.nonfinite for r in results if r.nonfinite), None)
    if nonfinite:
        return report.add("numerics", False, nonfinite)
    report.params = next((r.params for r in results if r.params), {})
    return True


def _compare_with_previous(report: CheckReport, run_dir: Path, step: int) -> bool:
    previous = None
    for s, path in sorted(layout.step_dirs(run_dir).items(), reverse=True):
        if s < step:
            try:
                previous = manifest.read(path)
            except CheckpointError:
                continue
            if previous is not None:
                break
    if previous is not None and previous.params and report.params != previous.params:
        names_a, names_b = set(previous.params), set(report.params)
        if names_a != names_b:
            detail = f"parameter names differ from step {previous.step}: {sorted(names_a ^ names_b)[:5]}"
        else:
            k = next(k for k in names_a if previous.params[k] != report.params[k])
            detail = f"{k} has shape {report.params[k]}, at step {previous.step} it had {previous.params[k]}"
        return report.add("numerics", False, detail)
    against = f"; {len(report.params)} parameters match step {previous.step}" if previous else ""
    return report.add("numerics", True, f"model and optimizer tensors are finite{against}")


def write_manifest(report: CheckReport, run: str, settings_fingerprint: str | None = None) -> manifest.Manifest:
    """Record a valid checkpoint's manifest in its folder, with the incarnation of the run that folder holds."""
    if not report.ok:
        failed = report.failed
        assert failed is not None  # validate_checkpoint's reports always hold a check: not ok means one failed
        raise CheckpointError(f"refusing to write a manifest for an invalid checkpoint: {failed.detail}")
    # a valid report reached past structure: it has its step and the actor's world size
    assert report.step is not None and report.world_size is not None
    m = manifest.Manifest(
        run=run,
        step=report.step,
        world_size=report.world_size,
        fsdp_version=report.fsdp_version,
        files=report.files,
        params=report.params,
        settings_fingerprint=settings_fingerprint,
        verl_version=manifest.verl_version(),
        checks=report.ran,
        skipped=report.skipped,
        resharded_from=_resharded_from(layout.step_dir(Path(report.run_dir), report.step)),
        incarnation=folder_incarnation(Path(report.run_dir)) or LEGACY_INCARNATION,
        certificate=commits.summary(commits.read(Path(report.run_dir), report.step)),
    )
    m.write(layout.step_dir(Path(report.run_dir), report.step))
    return m


def _resharded_from(step_dir: Path) -> dict[str, Any] | None:
    """The manifest's record of a reshard: the world size the step was written at, and the sha256 of its manifest."""
    record = record_of(step_dir)
    return None if record is None else {"world_size": record["world_size"], "manifest_sha256": record.get("manifest_sha256")}


def latest_valid_step(run_dir: Path) -> int | None:
    """The step the tracker names if that checkpoint is structurally whole; None for a fresh run.

    Cheap (no file is read). Raises CheckpointError when the run has checkpoints but the tracker's
    is missing or broken: a run must never silently start again at step 0.
    """
    run_dir = Path(run_dir)
    step = layout.read_tracker(run_dir)
    if step is None:
        real = [s for s, p in layout.step_dirs(run_dir).items() if not layout.is_rotation_leftover(p)]
        if real:
            raise CheckpointError(
                f"{run_dir} holds checkpoints (steps {real}) but no tracker ({layout.TRACKER})",
                f"run `python -m relay checkpoint validate {run_dir} --step {max(real)}`, and if it is valid "
                f"write {max(real)} into {layout.TRACKER}",
            )
        return None
    report = validate_checkpoint(run_dir, step, upto="consistency")
    if not report.ok:
        failed = report.failed
        assert failed is not None  # validate_checkpoint's reports always hold a check: not ok means one failed
        raise CheckpointError(
            f"the tracker of {run_dir} names step {step}, which is not a valid checkpoint: {failed.detail}",
            f"run `python -m relay checkpoint validate {run_dir}` and point the tracker at the newest valid step",
        )
    return step


def latest_step_or_problem(run_dir: Path) -> tuple[int | None, str | None]:
    """latest_valid_step for planning: (step, None), or (None, what is wrong) when the tracker's
    checkpoint is broken. The chunk's trainer then quarantines it and falls back (resume.py)."""
    try:
        return latest_valid_step(run_dir), None
    except CheckpointError as e:
        return None, e.what
