"""Reshard a verl FSDP checkpoint from world size K to world size M, in verl's own layout.

verl's FSDPCheckpointManager saves one model, optimizer and extra_state file per rank
(`model_world_size_K_rank_r.pt`, ...) and loads them only at world size K (verl issue #2265): a run whose
next reservation has another number of GPUs cannot resume. This module writes the same step at world size M:

- model shards: DTensors sharded on dim 0 (FSDP2, and FSDP1 with a device mesh as verl builds it; FSDP1 at
  world size 1 saves plain tensors, and is written so at 1), cut as torch cuts them (torch.chunk: ceil(n/M)
  rows a rank, the last ranks shorter or empty);
- optimizer shards: FSDP2's per-parameter DTensor states (Adam's exp_avg, exp_avg_sq) cut like their
  parameter; FSDP1's flat-parameter states (one per FSDP unit: the root, then each decoder layer, as verl's
  wrap policy builds them with use_orig_params false) re-cut from the unit's unpadded flat length;
  scalar and non-tensor state (`step`, param_groups) kept;
- extra_state per rank: the LR scheduler's state and the RNG states of rank r % K, byte for byte (the
  documented rule for ranks that did not exist: they take the RNG of the rank they wrap onto);
- fsdp_config.json with the new world size; huggingface/, data.pt and any other file as they were;
- relay_resharded.json: {world_size: K, manifest_sha256: the original manifest's}, which the gate's
  consistency check needs before it accepts a world size change (relay.checkpoints.validate).

Nothing loads a whole checkpoint: every input file is memory-mapped, and one output file is built at a
time, each tensor in its own memory map of a buffer file (page cache, not anonymous memory). A DTensor
records its device mesh; the mesh of rank r of M is made in this process with torch's fake process-group
backend (no peers, no collectives), as verl's would be made by rank r.

In place (the default), the reshard takes the run's lease (a trainer still alive is fenced out), writes the
new step under .relay/staging, fsyncs it, and swaps it with the old folder under the lease
(relay.checkpoints.swap: one renameat2 RENAME_EXCHANGE, or two journaled renames where the filesystem has no
exchange; an interrupted swap is finished or undone by the next reshard, `relay doctor`, the gate or a
resume); the world-size-K original is moved to .relay/resharded/, never deleted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.checkpoints import manifest, swap
from relay.checkpoints.reshard_record import RECORD
from relay.checkpoints.safeload import is_sharded_record, load
from relay.common import files
from relay.common.errors import CheckpointError, UsageError
from relay.common.faultpoint import fault_point
from relay.common.timestamps import utc_now
from relay.runs import layout
from relay.runs.lease import Lease

# A parameter of a decoder layer (verl's FSDP1 wrap policy makes each one a unit: _no_split_modules).
_LAYER = re.compile(r"(?:^|\.)layers\.([0-9]+)\.")


@dataclass
class ReshardResult:
    run_dir: Path
    step: int
    from_world_size: int
    to_world_size: int
    fsdp_version: int
    step_dir: Path  # where the world-size-M step now is
    original: Path | None  # where the world-size-K original was moved (in place), or None (--out)
    bytes_written: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "step": self.step,
            "from_world_size": self.from_world_size,
            "to_world_size": self.to_world_size,
            "fsdp_version": self.fsdp_version,
            "step_dir": str(self.step_dir),
            "original": str(self.original) if self.original else None,
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
        }

    def explain(self) -> str:
        where = (
            f"in place; the world-size-{self.from_world_size} original is kept in {self.original}"
            if self.original
            else f"into {self.step_dir}; the source is untouched"
        )
        return (
            f"resharded step {self.step} (FSDP{self.fsdp_version}) from world size {self.from_world_size} to "
            f"{self.to_world_size} {where}: {self.bytes_written / 2**20:.1f} MiB in {self.seconds:.1f}s"
        )


def bounds(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's part of a dimension of size n, as torch.chunk (DTensor's Shard, FSDP) cuts it."""
    size = math.ceil(n / world_size) if n else 0
    start = min(rank * size, n)
    return start, min(start + size, n)


def reshard(run_dir: Path, world_size: int, *, step: int | None = None, out: Path | None = None) -> ReshardResult:
    """Write step `step` (default: the tracker's) of a run at `world_size`: in place, or as a run folder `out`."""
    from relay.checkpoints.validate import validate_checkpoint

    t0 = time.time()
    run_dir = Path(run_dir)
    if not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(
            f"--world-size {world_size}: a world size is a number of processes, at least 1",
            "give the number of GPUs (processes) the next chunk trains on",
        )
    if out is None:
        peek = validate_checkpoint(run_dir, step, upto="consistency")  # reads no file: a no-op fences no trainer
        if peek.ok and peek.world_size == world_size:
            raise UsageError(f"{peek.path} is already at world size {world_size}", "nothing to do")
        # In place, the reshard is the run's writer, and the lease comes first: a trainer still alive, or another
        # reshard, loses it and stops at its next check; only then is a swap a killed writer left behind finished
        # or undone, and the step read, so that no writer swaps the step between this one's look and its write.
        lease = Lease(run_dir)
        token = lease.acquire(f"reshard:{socket.gethostname()}:{os.getpid()}")
        if done := swap.recover(run_dir):
            print(f"[relay] {done}", flush=True)
    report = validate_checkpoint(run_dir, step)
    if not report.ok:
        failed = report.failed
        raise CheckpointError(
            f"{report.path} is not a valid checkpoint, so it is not resharded: "
            f"{failed.name if failed else '?'}: {failed.detail if failed else ''}",
            f"run `python -m relay checkpoint validate {run_dir} --quarantine` to fall back to the "
            f"newest valid step, then reshard that one (--step)",
        )
    assert report.step is not None and report.world_size is not None
    step = report.step
    src = layout.step_dir(run_dir, step)
    k = report.world_size
    if k == world_size:
        raise UsageError(f"{src} is already at world size {k}", "nothing to do")
    fsdp_version = int(report.fsdp_version or 0)
    if fsdp_version not in (1, 2):
        raise CheckpointError(
            f"{src}/actor/fsdp_config.json records FSDP version {report.fsdp_version!r}; "
            "Relay reshards verl's FSDP1 and FSDP2 checkpoints only",
            f"resume at world size {k}",
        )
    original_manifest = manifest.path_of(src)
    sha = hashlib.sha256(original_manifest.read_bytes()).hexdigest() if original_manifest.is_file() else None

    if out is not None:
        out = Path(out)
        if layout.step_dir(out, step).exists():
            raise CheckpointError(f"{layout.step_dir(out, step)} already exists", "give an empty --out folder")
        staged = layout.relay_dir(out, "staging", f"{layout.step_name(step)}.reshard")
    else:
        # A staging folder of its own (its token). Older writers' left behind are removed: every swap of theirs was
        # finished or undone under this lease (recover() above), so they hold derived copies only. A newer writer's
        # is never touched: after its exchange, its staging folder holds the original until it is set aside.
        staged = layout.relay_dir(run_dir, "staging", f"{layout.step_name(step)}.reshard-{world_size}.t{token}")
        for old in staged.parent.glob(f"{layout.step_name(step)}.reshard-*") if staged.parent.is_dir() else ():
            older = old.name.rpartition(".t")[2]
            if not older.isdigit() or int(older) < token:
                shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    try:
        written = _write_step(src, staged, k, world_size, fsdp_version)
        files.atomic_write_json(
            staged / RECORD,
            {
                "world_size": k,
                "fsdp_version": fsdp_version,
                "manifest_sha256": sha,
                "to_world_size": world_size,
                "step": step,
                "resharded_at": utc_now(),
            },
        )
        files.fsync_tree(staged)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise

    if out is not None:
        final = layout.step_dir(out, step)
        staged.rename(final)
        files.fsync_dir(out)
        layout.write_tracker(out, step)
        return ReshardResult(run_dir, step, k, world_size, fsdp_version, final, None, written, time.time() - t0)

    aside = _aside(run_dir, step, k)
    fault_point("reshard_staged", step)
    with lease.commit(token):
        # The original is kept, never deleted; global_step_N names a whole checkpoint at every instant, whatever
        # kills this process (relay.checkpoints.swap).
        swap.replace_step(run_dir, step, staged, aside)
        if layout.read_tracker(run_dir) == step:
            layout.write_tracker(run_dir, step)  # the same commit as a trainer's save: durable, atomic
    return ReshardResult(run_dir, step, k, world_size, fsdp_version, src, aside, written, time.time() - t0)


def _aside(run_dir: Path, step: int, k: int) -> Path:
    """Where the world-size-k original of a step goes: named by its world size and the time, and never a name
    already taken (reshards back and forth within one second keep every original)."""
    name = f"{layout.step_name(step)}.world_size_{k}.{int(time.time())}"
    aside, n = layout.relay_dir(run_dir, "resharded", name), 1
    while aside.exists():
        aside, n = layout.relay_dir(run_dir, "resharded", f"{name}.{n}"), n + 1
    return aside


# ------------------------------------------------------------------------------------ the step


def _write_step(src: Path, dst: Path, k: int, m: int, fsdp_version: int) -> int:
    written = 0
    for entry in sorted(src.iterdir()):
        if entry.name in (manifest.NAME, RECORD):
            continue  # the gate writes the new step's manifest; a new record is written for this reshard
        if entry.is_dir() and entry.name in layout.ROLES:
            written += _write_role(entry, dst / entry.name, k, m, fsdp_version)
        elif entry.is_dir():
            shutil.copytree(entry, dst / entry.name)
        else:
            shutil.copy2(entry, dst / entry.name)
    return written


def _write_role(src: Path, dst: Path, k: int, m: int, fsdp_version: int) -> int:
    dst.mkdir(parents=True)
    for entry in sorted(src.iterdir()):
        if layout.SHARD.match(entry.name):
            continue
        if entry.name == "fsdp_config.json":
            cfg = json.loads(entry.read_text())
            (dst / entry.name).write_text(json.dumps({**cfg, "world_size": m}, indent=4))  # as verl writes it
        elif entry.is_dir():
            shutil.copytree(entry, dst / entry.name)
        else:
            shutil.copy2(entry, dst / entry.name)
    models = [load(src / layout.shard_name("model", k, r)) for r in range(k)]
    optims = [load(src / layout.shard_name("optim", k, r)) for r in range(k)]
    for r, sd in enumerate(models):
        if not isinstance(sd, dict) or not isinstance(optims[r], dict):
            raise CheckpointError(
                f"{src}: the model or optimizer shard of rank {r} is not a state dict",
                "resume at the world size it was written at",
            )
    # FSDP1 at world size 1 saves plain tensors (nothing is sharded), and verl's FSDP1 at 1 reads them so.
    plain_in, plain_out = fsdp_version == 1 and k == 1, fsdp_version == 1 and m == 1
    model_layout = _model_layout(src, models, plain_is_full=plain_in)
    flat_units = _flat_units(src, model_layout, optims, k) if fsdp_version == 1 else None
    written = 0
    for rank in range(m):
        with _mesh(model_layout.mesh_dim_names, m, rank) as mesh:
            builders: dict[str, Callable[..., dict[str, Any]]] = {
                "model": lambda out, rank=rank, mesh=mesh: {
                    name: _cut(
                        src, name, [sd[name] for sd in models], k, m, rank, mesh, out, plain_in=plain_in, plain_out=plain_out
                    )
                    for name in models[0]
                },
                "optim": lambda out, rank=rank, mesh=mesh: _optim(src, optims, k, m, rank, mesh, flat_units, out),
            }
            for kind, build in builders.items():
                measured = _Out()
                build(measured)  # the first pass only adds up the sizes
                path = dst / layout.shard_name(kind, m, rank)
                with _Out.backed_by(path.with_name(f".{path.name}.buf"), measured.nbytes) as out:
                    written += _save(build(out), path)
        # extra_state: the LR scheduler (the same on every rank) and the RNG of rank r % K, as written
        extra = dst / layout.shard_name("extra_state", m, rank)
        shutil.copyfile(src / layout.shard_name("extra_state", k, rank % k), extra)
        written += extra.stat().st_size
    return written


def _save(obj: Any, path: Path) -> int:
    import torch

    torch.save(obj, path)  # fsynced with the whole step (layout.fsync_tree) before it is renamed into place
    return path.stat().st_size


# ------------------------------------------------------------------------------ the tensors


@dataclass
class _ModelLayout:
    shapes: dict[str, tuple[int, ...]]  # parameter -> global shape, in the state dict's order
    mesh_dim_names: tuple[str, ...] | None  # None: a 1-D mesh made without names, kept so


def _placement(src: Path, name: str, value: Any) -> int | None:
    """The dimension a DTensor is sharded on (None: replicated, or a plain tensor), or a clear refusal."""
    if is_sharded_record(value):
        raise CheckpointError(
            f"{src}: {name} is an FSDP1 ShardedTensor (FSDP1 without a device mesh); Relay "
            "reshards DTensor shards only (verl passes a device mesh to FSDP)",
            "resume at the world size the checkpoint was written at",
        )
    spec = getattr(value, "_spec", None)
    if spec is None:
        return None
    if spec.mesh.ndim != 1:
        raise CheckpointError(
            f"{src}: {name} is sharded over a {spec.mesh.ndim}-D device mesh "
            f"({spec.mesh.mesh_dim_names}: HSDP or sequence parallel); Relay reshards 1-D FSDP meshes",
            "resume at the world size and mesh the checkpoint was written with",
        )
    placement = spec.placements[0]
    if placement.is_replicate():
        return None
    if not placement.is_shard() or getattr(placement, "dim", None) is None:
        raise CheckpointError(
            f"{src}: {name} has the placement {placement}, which Relay does not reshard",
            "resume at the world size the checkpoint was written at",
        )
    dim: int = placement.dim
    return dim


def _model_layout(src: Path, models: list[dict[str, Any]], plain_is_full: bool = False) -> _ModelLayout:
    names = list(models[0])
    for r, sd in enumerate(models[1:], 1):
        if list(sd) != names:
            raise CheckpointError(
                f"{src}: the model shards of ranks 0 and {r} hold different parameters",
                "the checkpoint is inconsistent; resume from an earlier step",
            )
    meshes = []
    shapes = {}
    for name in names:
        v = models[0][name]
        _placement(src, name, v)
        shapes[name] = tuple(v.shape)
        spec = getattr(v, "_spec", None)
        if spec is not None:
            meshes.append(spec.mesh.mesh_dim_names)
    if meshes:
        return _ModelLayout(shapes, meshes[0])
    if plain_is_full:
        return _ModelLayout(shapes, ("fsdp",))  # the mesh verl gives FSDP (verl.utils.device_mesh: "fsdp")
    # plain tensors only (buffers alone may be plain): not FSDP's sharded state dict
    raise CheckpointError(
        f"{src}: the model shards hold plain tensors, not FSDP's DTensors, so how they are "
        "sharded is unknown (an unknown placement); Relay reshards checkpoints of verl's "
        "FSDPCheckpointManager",
        "resume at the world size the checkpoint was written at",
    )


def _pieces(locals_: list[Any], dim: int, n: int, k: int, start: int, end: int) -> list[Any]:
    """Views of the input ranks' local tensors covering [start, end) of dimension `dim` (of size n)."""
    out = []
    for rank, local in enumerate(locals_):
        a, b = bounds(n, k, rank)
        lo, hi = max(a, start), min(b, end)
        if lo < hi:
            out.append(local.narrow(dim, lo - a, hi - lo))
    return out


class _Out:
    """Where one output file's tensors are built: each in its own memory map of one buffer file beside the output
    (shared pages of a file, not anonymous memory), so a rank's shard never has to fit in RAM; without a file, it
    only measures (the first pass: tensor() returns None and adds up the bytes). Each tensor starts its own
    storage, as in the files verl writes (torch 2.13 cannot pickle a DTensor whose local tensor starts inside a
    storage: "invalid python storage")."""

    ALIGN = 4096  # a page: each tensor's map starts on one

    def __init__(self, path: Path | None = None):
        self.path, self.nbytes = path, 0

    @classmethod
    @contextmanager
    def backed_by(cls, path: Path, nbytes: int) -> Iterator[_Out]:
        with open(path, "wb") as f:
            f.truncate(nbytes)  # sparse: pages are made as they are written
        try:
            yield cls(path)
        finally:
            path.unlink(missing_ok=True)

    def tensor(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import numpy as np
        import torch

        size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        offset = -(-self.nbytes // self.ALIGN) * self.ALIGN
        self.nbytes = offset + size
        if self.path is None:
            return None
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        raw = np.memmap(self.path, dtype=np.uint8, mode="r+", offset=offset, shape=(size,))
        return torch.from_numpy(raw).view(dtype).view(shape)


def _cut(
    src: Path,
    name: str,
    values: list[Any],
    k: int,
    m: int,
    rank: int,
    mesh: Any,
    out: _Out,
    *,
    plain_in: bool = False,
    plain_out: bool = False,
) -> Any:
    """Rank `rank` of M's value of one state entry, from the K ranks' values. plain_in: a plain tensor is the
    whole of a sharded one (FSDP1 at world size 1); plain_out: write the whole as a plain tensor (FSDP1 at 1)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    dim = _placement(src, name, values[0])
    if not isinstance(values[0], torch.Tensor):
        return values[rank % k]
    if dim is None and plain_in and getattr(values[0], "_spec", None) is None and values[0].dim() > 0:
        dim = 0
    if dim is None:
        return values[rank % k]  # replicated, or a plain tensor (a scalar step): the same on every rank
    shape = tuple(values[0].shape)
    locals_ = [v.to_local() if hasattr(v, "to_local") else v for v in values]
    for r, (v, local) in enumerate(zip(values, locals_, strict=False)):
        a, b = bounds(shape[dim], k, r)
        if tuple(v.shape) != shape or local.shape[dim] != b - a:
            raise CheckpointError(
                f"{src}: {name} of rank {r} holds rows {local.shape[dim]} of {shape} where torch "
                f"would hold {b - a} (an unknown placement)",
                "resume at the world size the checkpoint was written at",
            )
    start, end = bounds(shape[dim], m, rank)
    local = out.tensor(tuple(end - start if d == dim else s for d, s in enumerate(shape)), locals_[0].dtype)
    if local is None:
        return None
    at = 0
    for part in _pieces(locals_, dim, shape[dim], k, start, end):  # copied from the memory-mapped input
        local.narrow(dim, at, part.shape[dim]).copy_(part)
        at += part.shape[dim]
    if plain_out:
        return local
    return DTensor.from_local(
        local,
        mesh,
        [Shard(dim)],
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def _flat_units(src: Path, model: _ModelLayout, optims: list[dict[str, Any]], k: int) -> list[int]:
    """FSDP1 (use_orig_params false, verl's default): the unpadded length of each flat parameter, in the
    optimizer's order (the root unit, then one per decoder layer), checked against every input rank."""
    units: dict[str, int] = {"root": 0}
    tied = _tied_embeddings(src)
    for name, shape in model.shapes.items():
        if tied and name == "lm_head.weight":
            continue  # one parameter with embed_tokens.weight: in the flat parameter once
        m = _LAYER.search(name)
        key = f"layer{m.group(1)}" if m else "root"
        units[key] = units.get(key, 0) + math.prod(shape)
    lengths = list(units.values())
    states = [o.get("state", {}) for o in optims]
    n_states = max((len(s) for s in states), default=0)
    refuse = (
        "resume at the world size it was written at (Relay reshards FSDP1 checkpoints written by verl's "
        "wrap policy with fsdp_config.use_orig_params false)"
    )
    if n_states and n_states != len(lengths):
        raise CheckpointError(
            f"{src}: the FSDP1 optimizer holds {n_states} states, but verl's wrap policy would make "
            f"{len(lengths)} flat parameters of these {len(model.shapes)} parameters (an unknown "
            "placement)",
            refuse,
        )
    for r, state in enumerate(states):
        for idx, entry in state.items():
            n = lengths[int(idx)]
            for key, t in entry.items():
                if getattr(t, "dim", lambda: 0)() == 1 and t.numel() != math.ceil(n / k):
                    raise CheckpointError(
                        f"{src}: rank {r}'s optimizer state {idx}.{key} holds {t.numel()} values "
                        f"where a flat parameter of {n} at world size {k} holds {math.ceil(n / k)} "
                        "(an unknown placement)",
                        refuse,
                    )
    return lengths


def _tied_embeddings(src: Path) -> bool:
    try:
        return bool(json.loads((src / "huggingface" / "config.json").read_text()).get("tie_word_embeddings"))
    except (OSError, ValueError):
        return False


def _optim(
    src: Path, optims: list[dict[str, Any]], k: int, m: int, rank: int, mesh: Any, flat_units: list[int] | None, out: _Out
) -> dict[str, Any]:
    import torch

    base = optims[rank % k]
    result = {key: value for key, value in base.items() if key != "state"}  # param_groups and the like, as written
    state = {}
    for idx, entry in optims[0].get("state", {}).items():
        new = {}
        for key, value in entry.items():
            values = [o["state"][idx][key] for o in optims]
            if flat_units is not None and isinstance(value, torch.Tensor) and value.dim() == 1:
                new[key] = _cut_flat(values, flat_units[int(idx)], k, m, rank, out)
            else:
                new[key] = _cut(src, f"optimizer state {idx}.{key}", values, k, m, rank, mesh, out)
        state[idx] = new
    result["state"] = state
    return result


def _cut_flat(values: list[Any], n: int, k: int, m: int, rank: int, out: _Out) -> Any:
    """Rank `rank` of M's shard of an FSDP1 flat parameter's state of n values: torch.chunk's cut, padded
    with zeros to ceil(n / M), as FlatParamHandle shards it."""
    unpadded = [v.narrow(0, 0, b - a) for r, v in enumerate(values) for a, b in [bounds(n, k, r)]]
    start, end = bounds(n, m, rank)
    local = out.tensor((math.ceil(n / m),), values[0].dtype)
    if local is None:
        return None
    local.zero_()
    at = 0
    for part in _pieces(unpadded, 0, n, k, start, end):
        local.narrow(0, at, part.numel()).copy_(part)
        at += part.numel()
    return local


@contextmanager
def _mesh(dim_names: tuple[str, ...] | None, world_size: int, rank: int) -> Iterator[Any]:
    """The 1-D device mesh of rank `rank` of `world_size`, made without peers: torch's fake process-group
    backend answers for the others (nothing is communicated; only the mesh a DTensor records is needed)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise CheckpointError(
            "this process already belongs to a process group; a reshard needs a process of its own",
            "run `python -m relay checkpoint reshard` from the CLI or an Airflow task, not a trainer",
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,), mesh_dim_names=dim_names)
    finally:
        dist.destroy_process_group()
