"""A checkpoint's certificate: a fingerprint of the trained state, written by the trainer at every save and
recomputed by the trainer at every resume, after loading and before the first step.

`global_step_N/relay_certificate.json` holds, for the weights being saved:
- the probe: the log-probabilities of a fixed, seeded batch of sequences (their token ids are stored, so the
  check reads no data), computed in eval mode over the whole batch on every rank;
- a digest of every parameter that does not depend on how it is sharded: an additive hash of each element
  by its global flat index (summed over a rank's pieces and across ranks, so no rank gathers a tensor).
  Log-probabilities alone miss the rows of an embedding or a head that the probe never uses;
- the optimizer's step and learning rate, a digest of the dataloader's state and one of the RNG states.

It is a fingerprint, not a proof of equality: it shows that the state a trainer loaded behaves as the state
it saved on the probe, and that every parameter holds the same values at the same indices (a 64-bit sum of
mixed element hashes: two different tensors collide with probability about 2^-32). It proves nothing about
states the probe does not touch beyond that (an RNG or data position that is not in the checkpoint at all).

Exactness: parameters, the optimizer's step, the LR, the data position and (at an unchanged world size) the RNG
digest are compared exactly. The probe's log-probabilities are exact where the world size and the device
kind are unchanged and the kernels deterministic (Relay's CPU trainer pins threads and deterministic
algorithms); after a reshard or on another device or kernel they are compared within `tolerance`. FSDP1's flat
parameters (one per wrapped unit, cut by world size) are digested by the original parameters they hold, so their
digests are an unsharded model's too; a certificate written before that (`portable: false`) compares its digests
only at the world size it was taken at.

Written before the commit, beside the manifest that the gate writes later: the manifest's checksums cover it.
Plain torch, no spec; a trainer computes its probe and passes the pieces here.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relay.common import files

NAME = "relay_certificate.json"
# 2: the optimizer's moments and every parameter's step (`optimizer`, `optimizer_steps`); 3: the critic's parameters
# and optimizer moments, where the algorithm has one (`critic`, `critic_optimizer`); versions 1 and 2 are read too
VERSION = 3
READS = (1, 2, 3)
# Wrapper prefixes that FSDP1, activation checkpointing and torch.compile put in parameter names: the digest is
# keyed by the model's own names, so that a certificate does not depend on how the model was wrapped.
WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")

_MASK64 = (1 << 64) - 1
# A 32-bit mix per element (murmur3's finaliser constants), as signed 32-bit integers: an element's hash is a
# function of its bits and its global index; the ranks' sums of them are added in 64 bits.
_M1, _M2 = (c - (1 << 32) for c in (0x9E3779B9, 0x85EBCA6B))
_CHUNK = 1 << 24  # 32-bit lanes hashed at a time: bounded temporaries on a GPU


@dataclass
class Certificate:
    step: int
    world_size: int
    device: str  # "cpu", "cuda", ...: the kind, not the index
    probe_ids: list[list[int]]  # the probe's token ids, one list per sequence
    logprobs: list[list[float]]  # the log-probability of each next token of each sequence
    params: dict[str, str]  # parameter name -> 16 hex digits
    optimizer_step: int | None = None
    lr: float | None = None
    data: str | None = None  # digest of the dataloader's state
    rng: str | None = None  # digest of the RNG states
    probe_seconds: float | None = None
    torch: str | None = None
    pad_id: int = 0  # the token the probe's shorter sequences are padded with
    # False where the digests are of FSDP1's flat parameters (one per wrapped unit, cut by world size): they
    # compare only at the world size they were taken at
    portable: bool = True
    probe_dtype: str = "float32"  # the dtype the probe's logits were computed in (bfloat16 under mixed precision)
    # "<parameter>.<state>" -> 16 hex digits: the optimizer's per-parameter tensors (Adam's exp_avg, exp_avg_sq), by
    # global index as the parameters are; {} in a certificate written before they were covered
    optimizer: dict[str, str] = field(default_factory=dict)
    optimizer_steps: list[int] = field(default_factory=list)  # every parameter's step, the distinct values
    # the critic's (verl's value model, where the algorithm has one): its parameters' and optimizer moments' digests
    critic: dict[str, str] = field(default_factory=dict)
    critic_optimizer: dict[str, str] = field(default_factory=dict)
    version: int = VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True) + "\n"

    def write(self, step_dir: Path) -> Path:
        path = Path(step_dir) / NAME
        files.atomic_write(path, self.to_json().encode())
        return path

    def summary(self) -> str:
        tokens = sum(len(x) for x in self.logprobs)
        lr = "unknown" if self.lr is None else f"{self.lr:.6g}"
        took = f"; probe and digests took {self.probe_seconds * 1e3:.0f} ms" if self.probe_seconds is not None else ""
        critic = (
            f"the critic's {len(self.critic)} parameter and {len(self.critic_optimizer)} moment digests, "
            if self.critic
            else ""
        )
        return (
            f"step {self.step} at world size {self.world_size} on {self.device}: probe of {len(self.probe_ids)} "
            f"sequences ({tokens} log-probs), {len(self.params)} parameter digests, {len(self.optimizer)} optimizer "
            f"moment digests, {critic}optimizer step {self.optimizer_step}, lr {lr}{took}"
        )


def read(step_dir: Path) -> Certificate | None:
    """The step folder's certificate; None when it has none (written before certificates, or without Relay)."""
    path = Path(step_dir) / NAME
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        from relay.common.errors import CheckpointError

        raise CheckpointError(
            f"{path} cannot be read ({e})", "quarantine the checkpoint (`relay checkpoint validate RUN_DIR --quarantine`)"
        ) from None
    if not isinstance(d, dict) or d.get("version") not in READS:
        from relay.common.errors import CheckpointError

        raise CheckpointError(
            f"{path} is not a certificate of version {', '.join(map(str, READS))}",
            "resume with the Relay that wrote it, or quarantine the checkpoint",
        )
    try:
        return Certificate(**d)
    except TypeError as e:
        from relay.common.errors import CheckpointError

        raise CheckpointError(f"{path} is malformed ({e})", "remove the file to resume uncertified") from None


@dataclass
class Comparison:
    """What a resume's recomputed certificate says of the saved one."""

    ok: bool
    exact: bool  # the probe compared bit for bit (else within the tolerance)
    max_logprob_diff: float
    tolerance: float
    problems: list[str] = field(default_factory=list)

    def detail(self) -> str:
        how = "exact" if self.exact else f"within {self.tolerance:g}"
        probe = f"probe log-probs differ by at most {self.max_logprob_diff:.3g} ({how})"
        return probe if self.ok else "; ".join(self.problems)


def compare(saved: Certificate, now: Certificate, tolerance: float) -> Comparison:
    """Compare a resume's certificate with the saved one (see the module's docstring for what is exact)."""
    exact = saved.world_size == now.world_size and saved.device == now.device
    problems: list[str] = []
    differ = sorted(n for n in saved.params.keys() | now.params.keys() if saved.params.get(n) != now.params.get(n))
    if differ and not (saved.portable and now.portable) and saved.world_size != now.world_size:
        differ = []  # FSDP1's flat parameters are cut by world size: not comparable after a reshard
    if differ:
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        problems.append(f"{len(differ)} of {len(saved.params)} parameters hold other values than saved: {shown}")
    if saved.optimizer and now.optimizer:  # both cover the moments (a version-1 certificate does not)
        moved = sorted(
            k for k in saved.optimizer.keys() | now.optimizer.keys() if saved.optimizer.get(k) != now.optimizer.get(k)
        )
        if moved:
            shown = ", ".join(moved[:5]) + (f" and {len(moved) - 5} more" if len(moved) > 5 else "")
            problems.append(
                f"{len(moved)} of {len(saved.optimizer)} optimizer moments hold other values than saved: {shown}"
            )
    for part, kept, held in (
        ("critic parameters", saved.critic, now.critic),
        ("critic optimizer moments", saved.critic_optimizer, now.critic_optimizer),
    ):
        if kept:  # saved with a critic (a certificate of version 3 of a run that has one): the resume must hold it
            if moved := sorted(k for k in kept.keys() | held.keys() if kept.get(k) != held.get(k)):
                shown = ", ".join(moved[:5]) + (f" and {len(moved) - 5} more" if len(moved) > 5 else "")
                problems.append(f"{len(moved)} of {len(kept)} {part} hold other values than saved: {shown}")
    if saved.optimizer_steps and now.optimizer_steps and saved.optimizer_steps != now.optimizer_steps:
        problems.append(f"the parameters' optimizer steps are {now.optimizer_steps}, saved {saved.optimizer_steps}")
    for what, a, b in (
        ("the optimizer's step", saved.optimizer_step, now.optimizer_step),
        ("the learning rate", saved.lr, now.lr),
        ("the dataloader's state", saved.data, now.data),
    ):
        if a != b:
            problems.append(f"{what} is {b}, saved {a}")
    if exact and saved.rng != now.rng:
        problems.append("the RNG states differ from those saved")
    diff = math.inf
    if saved.probe_ids != now.probe_ids or [len(x) for x in saved.logprobs] != [len(x) for x in now.logprobs]:
        problems.append("the probe is not the one saved")
    else:
        diffs = [
            abs(a - b) for xs, ys in zip(saved.logprobs, now.logprobs, strict=True) for a, b in zip(xs, ys, strict=True)
        ]
        diff = math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)
        if math.isnan(diff) or (diff > 0 if exact else diff > tolerance):
            problems.append(f"the probe's log-probs differ from those saved by up to {diff:.3g}")
    return Comparison(not problems, exact, diff, tolerance, problems)


# ------------------------------------------------------------------------------------ probe and digests


def probe_logprobs(model: Any, probe_ids: list[list[int]], pad_id: int) -> list[list[float]]:
    """The probe's log-probs under a causal LM (a Hugging Face model's `logits`): one forward in eval mode, no
    gradient, no random draw, over the sequences padded on the right (causal attention: a pad never reaches the
    positions before it); each sequence's next-token log-probs."""
    return probe(model, probe_ids, pad_id)[0]


def probe(model: Any, probe_ids: list[list[int]], pad_id: int) -> tuple[list[list[float]], str]:
    """probe_logprobs, and the dtype the logits were computed in ("bfloat16" under FSDP's mixed precision)."""
    import torch

    training = model.training
    model.eval()
    width = max(len(seq) for seq in probe_ids)
    device = next(model.parameters()).device
    padded = torch.tensor([seq + [pad_id] * (width - len(seq)) for seq in probe_ids], device=device)
    with torch.no_grad():
        logits = model(input_ids=padded).logits[:, :-1]
        dtype = str(logits.dtype).removeprefix("torch.")
        lp = torch.log_softmax(logits.float(), -1).gather(-1, padded[:, 1:].unsqueeze(-1)).squeeze(-1).cpu()
    model.train(training)
    return [lp[i, : len(seq) - 1].tolist() for i, seq in enumerate(probe_ids)], dtype


def param_digests(model: Any, *, reduce: Any = None) -> dict[str, str]:
    """{parameter name: 16 hex digits} of a model's parameters and persistent buffers, whatever their sharding
    (FSDP1's flat parameters, FSDP2's DTensors, none): each rank hashes its own pieces by their global indices;
    `reduce(list of int64 sums) -> list` adds the ranks' sums (torch.distributed's all_reduce over a tensor; None
    at world size 1)."""
    return _digests(named_pieces(model), reduce=reduce)


def digests(named: Iterable[tuple[str, Any]], *, reduce: Any = None) -> dict[str, str]:
    """param_digests of (name, tensor) pairs: a state dict's items, say."""
    return _digests([(name, local_piece(tensor)) for name, tensor in named], reduce=reduce)


def _digests(pieces: list[tuple[str, tuple[Any, int] | None]], *, reduce: Any = None) -> dict[str, str]:
    sums = piece_sums([piece for _, piece in pieces])
    if reduce is not None:
        sums = list(reduce(sums))
    return {n: f"{s & _MASK64:016x}" for (n, _), s in zip(pieces, sums, strict=True)}


def optimizer_pieces(model: Any, optimizer: Any) -> tuple[list[tuple[str, tuple[Any, int] | None]], list[int]]:
    """This rank's pieces of the optimizer's per-parameter tensors ("<parameter>.<state>", as named_pieces gives the
    parameters': FSDP1's flat states through the handle's record, FSDP2's DTensors by their global offsets), and the
    distinct steps of the parameters (a scalar per parameter, the same on every rank)."""
    own = _optimized_names(model, optimizer)
    flats = dict(_fsdp1_flat_params(model))
    # FSDP1's flat parameters, by identity or by the storage they share with the optimizer's
    flat_by_id = {id(flat): (prefix, flat) for prefix, flat in flats.items()}
    flat_by_storage = {key: (prefix, flat) for prefix, flat in flats.items() if (key := _storage_key(flat)) is not None}
    # FSDP1's original parameters under use_orig_params: views of a flat piece, placed by the handle's record
    placed = {
        _own_name(prefix + fqn): info
        for prefix, flat in flats.items()
        for fqn, info in zip(flat._fqns, flat._shard_param_infos, strict=True)
    }
    pieces: list[tuple[str, tuple[Any, int] | None]] = []
    steps: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p) or {}
            for key in sorted(state):
                t = state[key]
                if not hasattr(t, "shape") or len(t.shape) == 0:
                    if key == "step":
                        steps.add(int(t.full_tensor() if hasattr(t, "full_tensor") else t))
                    continue
                hit = flat_by_id.get(id(p)) or (flat_by_storage.get(_storage_key(p) or ()) if _is_flat(p) else None)
                if hit is not None:
                    pieces += [(f"{name}.{key}", piece) for name, piece in _flat_pieces(*hit, t)]
                elif (name := own.get(id(p))) is not None:
                    info = placed.get(name)
                    if info is not None:
                        piece = (t.detach().reshape(-1), info.intra_param_start_idx) if info.in_shard else None
                    else:
                        piece = local_piece(t)
                    pieces.append((f"{name}.{key}", piece))
    return pieces, sorted(steps)


def _optimized_names(model: Any, optimizer: Any) -> dict[int, str]:
    """{id(optimizer's parameter): the model's own name for it}. By identity where the optimizer holds the model's
    parameter objects; else by the storage they share (FSDP2 may register new Parameter objects over the same storage
    after the optimizer was built); else by position, as torch's optimizer state_dict keys them, when the optimizer
    holds as many parameters as the model."""
    named = []
    seen: set[int] = set()
    for name, t in model.named_parameters():
        if id(t) not in seen:
            seen.add(id(t))
            named.append((_own_name(name), t))
    held = [p for group in optimizer.param_groups for p in group["params"]]
    by_id = {id(t): n for n, t in named}
    by_storage = {key: n for n, t in named if (key := _storage_key(t)) is not None}
    out = {}
    for i, p in enumerate(held):
        name = by_id.get(id(p)) or by_storage.get(_storage_key(p) or ())
        if name is None and len(held) == len(named):
            name = named[i][0]
        if name is not None:
            out[id(p)] = name
    return out


def _storage_key(t: Any) -> tuple[Any, ...] | None:
    local = t.to_local() if hasattr(t, "to_local") else t
    if local.numel() == 0:
        return None
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))


def optimizer_digests(model: Any, optimizer: Any, *, reduce: Any = None) -> tuple[dict[str, str], list[int]]:
    """optimizer_pieces' digests (reduced across ranks as param_digests'), and the parameters' distinct steps."""
    pieces, steps = optimizer_pieces(model, optimizer)
    return _digests(pieces, reduce=reduce), steps


def optimizer_digests_of_copy(
    model: Any, optimizer: Any, saved: dict[str, Any], *, reduce: Any = None
) -> tuple[dict[str, str], list[int]]:
    """optimizer_digests of the state in `saved`, a copy of `optimizer.state_dict()` as a save took it (torch keys
    its states by the parameters' positions in the param groups): each position named through the live optimizer's
    parameter there, so that the digests are those of the live state at the save, computed later from the copy."""
    from types import SimpleNamespace

    live = [p for group in optimizer.param_groups for p in group["params"]]
    keys = [k for group in saved["param_groups"] for k in group["params"]]
    states = saved.get("state", {})
    view = SimpleNamespace(
        param_groups=optimizer.param_groups, state={p: states.get(k, {}) for p, k in zip(live, keys, strict=True)}
    )
    return optimizer_digests(model, view, reduce=reduce)


def portable(model: Any) -> bool:
    """Whether every parameter's digest is independent of the sharding: each of FSDP1's flat parameters is read
    through its handle's record of the original parameters it holds (named_pieces); one that cannot be is not."""
    covered = {id(flat) for _, flat in _fsdp1_flat_params(model)}
    return not any(_is_flat(p) and id(p) not in covered for p in model.parameters())


def named_pieces(model: Any) -> list[tuple[str, tuple[Any, int] | None]]:
    """(name, this rank's piece) for every parameter and persistent buffer of the model by its own name (wrapper
    prefixes removed), a piece being (tensor, global flat offset), or None where another rank holds all of it. FSDP1
    keeps a wrapped unit's parameters as one flat parameter, cut into equal pieces by world size (padding between
    the originals included): its pieces are read through the handle's record of where each original parameter's
    elements lie in this rank's piece, so the digests match an unsharded model's at any world size."""
    out: list[tuple[str, tuple[Any, int] | None]] = []
    covered: set[int] = set()
    for prefix, flat in _fsdp1_flat_params(model):
        covered.add(id(flat))
        out += _flat_pieces(prefix, flat, flat)  # this rank's piece of it (sharded, outside a forward)
    seen = {name for name, _ in out}
    for name, t in named_state(model):
        # FSDP1's original parameters under use_orig_params are views of the flat piece, already counted above
        if name not in seen and id(t) not in covered:
            seen.add(name)
            out.append((name, local_piece(t)))
    return out


def _flat_pieces(prefix: str, flat: Any, values: Any) -> list[tuple[str, tuple[Any, int] | None]]:
    """(own name, piece) of each original parameter of FSDP1's flat parameter `flat`, cut from `values` (this rank's
    piece of the flat parameter, or of an optimizer state shaped as it) where the handle records it lies."""
    local = values.detach().reshape(-1)
    return [
        (
            _own_name(prefix + fqn),
            (local[i.offset_in_shard : i.offset_in_shard + i.numel_in_shard], i.intra_param_start_idx)
            if i.in_shard
            else None,
        )
        for fqn, i in zip(flat._fqns, flat._shard_param_infos, strict=True)
    ]


def _is_flat(p: Any) -> bool:
    # torch's FlatParameter.__new__ returns a plain Parameter marked with this flag: its type says nothing
    return bool(getattr(p, "_is_flat_param", False))


def _fsdp1_flat_params(model: Any) -> list[tuple[str, Any]]:
    """(name prefix of its originals, flat parameter) for each FSDP1 unit of the model whose handle records where
    its original parameters lie."""
    found = []
    for mod_name, mod in model.named_modules():
        flat = getattr(getattr(mod, "_handle", None), "flat_param", None)
        if flat is not None and _is_flat(flat) and hasattr(flat, "_fqns") and hasattr(flat, "_shard_param_infos"):
            # the handle's names are relative to the module FSDP wraps: <unit>._fsdp_wrapped_module
            found.append((f"{mod_name}.{WRAPPERS[0]}" if mod_name else WRAPPERS[0], flat))
    return found


def _own_name(name: str) -> str:
    for w in WRAPPERS:
        name = name.replace(w, "")
    return name


def named_state(model: Any) -> Iterable[tuple[str, Any]]:
    """A model's parameters and persistent buffers by their own names (wrapper prefixes removed)."""
    seen = set()
    for name, t in list(model.named_parameters()) + list(_persistent_buffers(model)):
        name = _own_name(name)
        if name not in seen:
            seen.add(name)
            yield name, t


def _persistent_buffers(model: Any) -> Iterable[tuple[str, Any]]:
    for mod_name, mod in model.named_modules():
        skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in skip:
                yield (f"{mod_name}.{b_name}" if mod_name else b_name), b


def local_piece(t: Any) -> tuple[Any, int] | None:
    """This rank's piece of a tensor and its global flat offset; None where another rank counts it. A DTensor
    piece replicated over a mesh dimension counts only on that dimension's first coordinate (else ranks would add
    it twice); a piece sharded other than along dim 0 is gathered whole and counted once."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return t, 0
    mesh, placements = t.device_mesh, t.placements
    coords = mesh.get_coordinate() or [0] * mesh.ndim
    if any(isinstance(p, Replicate) and c != 0 for p, c in zip(placements, coords, strict=True)):
        return None
    if all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0) for p in placements):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
        row = math.prod(t.shape[1:]) if len(t.shape) > 1 else 1
        return t.to_local(), (offset[0] * row if offset else 0)
    full = t.full_tensor()
    return (full, 0) if all(c == 0 for c in coords) else None


def tensor_sum(t: Any, offset: int) -> int:
    """Sum over a tensor's elements (flattened, starting at global flat index `offset`) of a splitmix64 mix of
    the element's bits and its index, modulo 2^64: moving a value to another index changes it."""
    return piece_sums([(t, offset)])[0]


def piece_sums(pieces: list[tuple[Any, int] | None]) -> list[int]:
    """tensor_sum of each (tensor, offset) piece (0 for None), the elements of many small tensors hashed together
    in batches of up to _CHUNK lanes: a model's few hundred tensors cost a few vector operations, not a few
    thousand. An element is hashed as 32-bit lanes (one, or two for an 8-byte dtype, at index 2i and 2i+1)."""
    import torch

    out = [0] * len(pieces)
    batch: list[tuple[int, Any, int]] = []  # (piece index, lanes, global lane index of its first lane)
    size = 0

    def flush() -> None:
        nonlocal batch, size
        if not batch:
            return
        device = batch[0][1].device
        lanes = torch.cat([b for _, b, _ in batch]) if len(batch) > 1 else batch[0][1]
        # global lane indices modulo 2^32, as int32 (wrapping): each piece's start, then counting up
        idx = torch.cat([torch.arange(b.numel(), dtype=torch.int32, device=device).add_(_wrap32(o)) for _, b, o in batch])
        x = _mix(lanes, idx)
        for (i, _piece, _offset), part in zip(batch, torch.split(x, [b.numel() for _, b, _ in batch]), strict=True):
            out[i] = (out[i] + int(part.sum(dtype=torch.int64))) & _MASK64
        batch, size = [], 0

    for i, piece in enumerate(pieces):
        if piece is None:
            continue
        t, offset = piece
        lanes, per = _lanes(t.detach().reshape(-1))
        for start in range(0, lanes.numel(), _CHUNK):
            x = lanes[start : start + _CHUNK]
            if batch and (x.device != batch[0][1].device or size + x.numel() > _CHUNK):
                flush()
            batch.append((i, x, offset * per + start))
            size += x.numel()
    flush()
    return out


def _wrap32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _mix(lanes: Any, idx: Any) -> Any:
    """A 32-bit hash of (lane bits, lane index) in wrapping int32 arithmetic: multiply, xor-shift, multiply. In
    place, into `idx` (fresh memory per operation costs more than the arithmetic)."""
    import torch

    x = idx.mul_(_M1)
    x ^= lanes
    x *= _M2
    t = x >> 15
    t &= 0x1FFFF  # a logical shift: torch's >> on int32 is arithmetic
    x ^= t
    x *= _M1
    torch.bitwise_right_shift(x, 13, out=t)
    t &= 0x7FFFF
    x ^= t
    return x


def _lanes(flat: Any) -> tuple[Any, int]:
    """A flat tensor's bits as int32 lanes, and lanes per element (2 for an 8-byte dtype, else 1)."""
    import torch

    size = flat.element_size()
    if size in (4, 8):
        return flat.contiguous().view(torch.int32), size // 4
    if flat.dtype.is_floating_point or flat.dtype.is_complex:
        flat = flat.contiguous().view(torch.int16 if size == 2 else torch.int8)
    return flat.to(torch.int32), 1


def state_digest(obj: Any) -> str:
    """A digest of nested state (dicts, lists, tuples, tensors, numpy arrays, numbers, strings), independent of
    how it was serialized: RNG states, a dataloader's state_dict."""
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()[:16]


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, Mapping):
        h.update(b"{")
        for k in sorted(obj, key=str):
            h.update(str(k).encode() + b":")
            _feed(h, obj[k])
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _feed(h, v)
        h.update(b"]")
    elif hasattr(obj, "detach"):  # a tensor
        h.update(f"T{obj.dtype}{tuple(obj.shape)}".encode())
        h.update(_tensor_bytes(obj))
    elif hasattr(obj, "tobytes"):  # a numpy array
        h.update(f"A{obj.dtype}{obj.shape}".encode() + obj.tobytes())
    else:
        h.update(repr(obj).encode())


def _tensor_bytes(t: Any) -> bytes:
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
