"""verl's FSDP1 (`fsdp_version: 1`) on Relay's CPU platform. verl wraps every FSDP1 model with
`sync_module_states=True`, and torch refuses that broadcast for CPU tensors; the CPU platform lifts that check only
(relay.trainers.verl_ppo.cpu.patches, patch 3), so ranks above 0 take rank 0's weights over gloo as they would take
them over NCCL on GPUs, and nothing is left uninitialised for a certificate to certify.

CI: torch's FSDP1 with verl's settings at world size 2, rank 1 built with other weights: after the wrap both ranks
hold rank 0's (and without the patch torch refuses, as verl's job did). verl's lane (`./scripts/test.sh --verl`):
include/runs/verl_tiny_cpu.yaml with `fsdp_version: 1`: two chunks with a kill in the second, resumed, certified at
every resume and nothing quarantined; step 1 at world size 2 within 1e-4 of the FSDP2 run's; and a reshard 1 -> 2
-> 1, each resume certified."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from relay.devstack import stack
from relay.jobs import local_head
from relay.runs import layout
from relay.runs.metrics import read_events
from support.helpers import ROOT, relay_cli
from support.ports import free_port
from support.verl_jobs import finish, full_model, killed_after_step_3, relay_train, spec_variant

RANK = textwrap.dedent("""
    import hashlib, json, sys
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    dist.init_process_group("gloo")
    if sys.argv[1] == "patched":
        from relay.trainers.verl_ppo.cpu import patches as cpu_patches
        cpu_patches._allow_fsdp1_sync_of_cpu_states()
    torch.manual_seed(dist.get_rank())  # rank 1 starts with weights of its own
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        wrapped = FSDP(model, device_id=torch.device("cpu"), sync_module_states=True, use_orig_params=False)
    except ValueError as e:
        print("RESULT " + json.dumps({"refused": str(e)}), flush=True)
        sys.exit(0)
    with FSDP.summon_full_params(wrapped):
        after = {k: v.detach().clone() for k, v in wrapped.module.state_dict().items()}
    digest = lambda sd: hashlib.sha256(b"".join(sd[k].numpy().tobytes() for k in sorted(sd))).hexdigest()
    print("RESULT " + json.dumps({"before": digest(before), "after": digest(after)}), flush=True)
    dist.destroy_process_group()
""")


def fsdp1_ranks(how: str) -> list[dict]:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "plugins"),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, how],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outs)
    return [json.loads(next(ln for ln in o.splitlines() if ln.startswith("RESULT "))[7:]) for o in outs]


@pytest.mark.processes
def test_fsdp1s_sync_of_module_states_gives_every_rank_rank_0s_weights_on_the_cpu():
    refused = fsdp1_ranks("torch")
    assert "requires them to be on GPU" in refused[0]["refused"], "torch's check, as verl's FSDP1 job met it"
    rank0, rank1 = fsdp1_ranks("patched")
    assert rank0["before"] != rank1["before"], "the ranks start with different weights"
    assert rank0["after"] == rank1["after"] == rank0["before"], "both ranks hold rank 0's weights after the wrap"


# ------------------------------------------------------------------------------------------------ verl's lane


def fsdp1_spec(path, checkpoint_dir, n_gpus: int, fsdp: int = 1):
    return spec_variant(
        path, checkpoint_dir, {"fsdp_version": fsdp, "n_gpus_per_node": n_gpus}, {"on_world_size_change": "reshard"}
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("verl_fsdp1")
    one, two = fsdp1_spec(base / "one.yaml", base / "one", 1), fsdp1_spec(base / "two.yaml", base / "two", 2)
    fsdp2_two = fsdp1_spec(base / "fsdp2.yaml", base / "fsdp2", 2, fsdp=2)
    chunked, at2, at2_fsdp2 = (base / d / "verl_tiny_cpu" for d in ("one", "two", "fsdp2"))
    logs = {}
    with local_head.local_head(
        stack.ray_cli(), stack.ray_env(local_s3=False), num_cpus=stack.head_cpus(), num_gpus=2, avoid=stack.stack_ray_ports()
    ) as head:
        logs["c1"] = finish(relay_train(chunked, 2, head.address, base / "c1.log", spec=one), base / "c1.log")
        logs["killed"] = killed_after_step_3(chunked, head.address, base / "c2.log", 5, spec=one)
        logs["c2"] = finish(relay_train(chunked, 4, head.address, base / "c2b.log", spec=one), base / "c2b.log")
        for run, spec, name in ((at2, two, "ws2"), (at2_fsdp2, fsdp2_two, "fsdp2_ws2")):
            logs[name] = finish(relay_train(run, 1, head.address, base / f"{name}.log", spec=spec), base / f"{name}.log")
        # a reshard 1 -> 2 -> 1 of the chunked run's step 4, each world size resuming it for a step
        resharded = base / "resharded" / "verl_tiny_cpu"
        shutil.copytree(chunked, resharded)
        for world_size, spec, to in ((2, two, 5), (1, one, 6)):
            out = relay_cli("checkpoint", "reshard", str(resharded), "--world-size", str(world_size))
            assert out.returncode == 0, out.stdout + out.stderr
            log = base / f"reshard{world_size}.log"
            logs[f"reshard{world_size}"] = finish(relay_train(resharded, to, head.address, log, spec=spec), log)
    return {"chunked": chunked, "at2": at2, "at2_fsdp2": at2_fsdp2, "resharded": resharded, "logs": logs}


def certificates(run_dir) -> list[tuple[int, str]]:
    return [(e["step"], e["certificate"]) for e in read_events(run_dir) if e["event"] == "resume_certificate"]


@pytest.mark.lane("verl")
def test_a_chunked_fsdp1_run_with_a_kill_resumes_certified_and_quarantines_nothing(runs):
    run = runs["chunked"]
    assert layout.read_tracker(run) == 4
    assert certificates(run) == [(2, "certified"), (2, "certified")], "the killed chunk's resume and its retry's"
    assert not layout.relay_dir(run, "quarantine").exists() or not any(layout.relay_dir(run, "quarantine").iterdir())
    assert "certified resume from step 2" in runs["logs"]["c2"]


@pytest.mark.lane("verl")
def test_fsdp1_at_world_size_2_trains_step_1_as_fsdp2_does(runs):
    """Both runs resharded to world size 1 (their full weights); FSDP1 and FSDP2 reduce the gradients alike but not
    bit for bit."""
    full = {}
    for name in ("at2", "at2_fsdp2"):
        out = runs[name].parent / f"{name}-full"
        r = relay_cli("checkpoint", "reshard", str(runs[name]), "--world-size", "1", "--out", str(out))
        assert r.returncode == 0, r.stdout + r.stderr
        full[name] = full_model(layout.step_dir(out, 1), 1)
    assert full["at2"].keys() == full["at2_fsdp2"].keys()
    worst = max((full["at2"][k].float() - full["at2_fsdp2"][k].float()).abs().max().item() for k in full["at2"])
    assert worst <= 1e-4, f"FSDP1 and FSDP2 differ by {worst} after step 1"


@pytest.mark.lane("verl")
def test_an_fsdp1_checkpoint_resharded_1_2_1_resumes_certified_at_each_world_size(runs):
    run = runs["resharded"]
    assert layout.read_tracker(run) == 6
    assert certificates(run)[-2:] == [(4, "certified"), (5, "certified")], certificates(run)
    assert "certified resume from step 4" in runs["logs"]["reshard2"]
    assert "certified resume from step 5" in runs["logs"]["reshard1"]
