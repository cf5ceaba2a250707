"""Certificate digests on real FSDP modules (torch.distributed on gloo, one process per rank): the same weights and
optimizer moments give the same digests, by the model's own parameter names, at world sizes 1, 2 and 3, with FSDP1
(its flat parameters, with and without use_orig_params, one unit or one per layer) and FSDP2, as the unsharded
model's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from relay.checkpoints import certificate
from support.helpers import ROOT

pytestmark = pytest.mark.processes  # ranks in processes of their own

# FSDP1 with one unit, FSDP1 with use_orig_params and a unit per Linear, FSDP2 with a unit per Linear
HOWS = ("fsdp1", "fsdp1_orig_per_layer", "fsdp2")
RANK = f"HOWS = {HOWS!r}\n" + textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from relay.checkpoints import certificate

    def sharded(how):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Embedding(11, 5), torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3), torch.nn.LayerNorm(3)
        )
        if how == "fsdp2":
            from torch.distributed.fsdp import fully_shard
            for layer in (model[1], model[3]):
                fully_shard(layer)
            return fully_shard(model)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        policy = ModuleWrapPolicy({torch.nn.Linear}) if how.endswith("per_layer") else None
        return FSDP(model, device_id=torch.device("cpu"), use_orig_params="orig" in how, auto_wrap_policy=policy)

    def reduce(sums):
        total = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in sums], dtype=torch.int64)
        dist.all_reduce(total)  # int64 wraps: the sum modulo 2^64
        return [int(v) for v in total.tolist()]

    def moments(model):
        # Adam's state as a step leaves it, made from each (local) parameter: what is where is the parameter's
        opt = torch.optim.Adam(model.parameters())
        for p in opt.param_groups[0]["params"]:
            opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": p.detach() * 2, "exp_avg_sq": p.detach() ** 2}
        return opt

    dist.init_process_group("gloo")
    got = {}
    for how in HOWS:
        model = sharded(how)
        optimizer, steps = certificate.optimizer_digests(model, moments(model), reduce=reduce)
        got[how] = {
            "digests": certificate.param_digests(model, reduce=reduce),
            "portable": certificate.portable(model),
            "optimizer": optimizer,
            "steps": steps,
        }
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(got), flush=True)
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded(world_size: int) -> dict:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "plugins"),
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world_size)
    ]
    outs = [p.communicate(timeout=300)[0] for p in ranks]
    assert all(p.returncode == 0 for p in ranks), "\n".join(o[-2000:] for o in outs)
    [line] = [ln for ln in outs[0].splitlines() if ln.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def _unsharded() -> tuple[dict[str, str], dict[str, str]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, 5), torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3), torch.nn.LayerNorm(3)
    )
    opt = torch.optim.Adam(model.parameters())
    for p in opt.param_groups[0]["params"]:
        opt.state[p] = {"step": torch.tensor(3.0), "exp_avg": p.detach() * 2, "exp_avg_sq": p.detach() ** 2}
    optimizer, steps = certificate.optimizer_digests(model, opt)
    assert steps == [3]
    return certificate.param_digests(model), optimizer


def test_digests_of_sharded_weights_are_the_unsharded_models_at_every_world_size():
    want, moments = _unsharded()
    assert set(want) == {"0.weight", "1.weight", "1.bias", "3.weight", "3.bias", "4.weight", "4.bias"}
    assert set(moments) == {f"{n}.{k}" for n in want for k in ("exp_avg", "exp_avg_sq")}
    for world_size in (1, 2, 3):
        got = _sharded(world_size)
        for how in HOWS:
            assert got[how]["digests"] == want, f"{how} at world size {world_size}"
            assert got[how]["portable"], f"{how} at world size {world_size}: its digests depend on no sharding"
            assert got[how]["optimizer"] == moments and got[how]["steps"] == [3], f"{how}'s moments at {world_size}"
