"""Ways to damage a verl checkpoint, each named in the checkpoint issue: shared by the validation tests
(tests/checkpoints/test_validate.py) and the corruption fault cases (tests/faults/test_corruption.py), so that
both hold Relay to the same defects. Each takes a checkpoint's step folder (global_step_N) of any run.

DEFECTS: name -> (damage(step_dir), the check that must refuse it, words its detail must hold).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from relay.runs import layout

MARKER = "PWNED"  # what a pickle that runs code writes: its existence anywhere proves the code ran


def shard(step_dir: Path, kind: str, rank: int = 0) -> Path:
    """The actor's `kind` shard (model, optim, extra_state) of `rank`, whatever the world size."""
    found = sorted((Path(step_dir) / "actor").glob(f"{kind}_world_size_*_rank_{rank}.pt"))
    assert len(found) == 1, f"expected one {kind} shard of rank {rank} in {step_dir}/actor, found {found}"
    return found[0]


def truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def flip(p: Path) -> None:
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x01
    p.write_bytes(bytes(b))


def nan(p: Path) -> None:
    """One NaN in the embedding (a DTensor's local part under FSDP2, a plain tensor under FSDP1)."""
    import torch
    import torch.distributed.tensor

    sd = torch.load(p, weights_only=True)
    t = sd["model.embed_tokens.weight"]
    (t.to_local() if hasattr(t, "to_local") else t)[0, 0] = float("nan")
    torch.save(sd, p)


def runs_code(p: Path, marker: Path) -> None:
    """A .pt whose unpickling would run code: it would write `marker`."""
    import torch

    class Evil:
        def __reduce__(self):
            return (exec, (f"open({str(marker)!r}, 'w').write('ran')",))

    torch.save({"rng": Evil()}, p)


def change_world_size(step_dir: Path, world_size: int = 2) -> None:
    """The checkpoint as a run of another world size would have written it: each rank-0 shard renamed
    to world size `world_size` (one copy per rank), and fsdp_config.json recording that world size."""
    actor = Path(step_dir) / "actor"
    for kind in layout.SHARD_KINDS:
        src = shard(step_dir, kind)
        for rank in range(1, world_size):
            shutil.copyfile(src, actor / layout.shard_name(kind, world_size, rank))
        src.rename(actor / layout.shard_name(kind, world_size, 0))
    cfg = actor / "fsdp_config.json"
    if cfg.is_file():
        cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "world_size": world_size}, indent=4))


DEFECTS = {
    "missing optim": (lambda s: shard(s, "optim").unlink(), "structure", "optim_world"),
    "missing extra_state": (lambda s: shard(s, "extra_state").unlink(), "structure", "extra_state"),
    "missing data.pt": (lambda s: (s / "data.pt").unlink(), "structure", "data.pt"),
    "truncated shard": (lambda s: truncate(shard(s, "model")), "integrity", "truncated"),
    "zero-byte shard": (lambda s: shard(s, "model").write_bytes(b""), "structure", "(empty)"),
    "flipped byte": (lambda s: flip(shard(s, "optim")), "integrity", "CRC32"),
    "NaN weights": (lambda s: nan(shard(s, "model")), "numerics", "NaN"),
    # The marker goes in the run folder, which stays put when the checkpoint is quarantined.
    "pickle runs code": (lambda s: runs_code(shard(s, "extra_state"), s.parent / MARKER), "loadability", "unsafe"),
}
