"""A verl run trained at world size 2, resharded to 1 and resumed by verl's own trainer on CPUs (the lane of
`./scripts/test.sh --verl`, marked lane("verl")): include/runs/verl_tiny_cpu.yaml at n_gpus_per_node 2 trains
chunk 1 (0 -> 2) on a Ray head with two logical GPUs; one copy of the run goes on at world size 2 (2 -> 4), the
other is resharded in place to world size 1 (`relay checkpoint reshard`) and goes on at world size 1 through
`relay train` with checkpoints.on_world_size_change: reshard; a third copy has its two ranks' model shards
swapped (same shapes, finite, its checksums made again), which verl loads and the certificate refuses. And the run
resharded to world size 1, grown back to 2 at its last step with that step's two ranks swapped: the certificate
refuses it, the run falls back to a step saved at world size 1, and the next `relay train`
(checkpoints.on_world_size_change: reshard) reshards that step to world size 2 and trains on.

What is equal, and the tolerance for the rest: the data order and the LR at steps 3 and 4 exactly, and the
rewards too (the weights after step 2 are the same bits, and generation is seeded per sample); the loss
within 1e-5 and the KL within 2% relative (world size 2 splits the batch over two ranks whose gradients are
summed, so the floats differ); the step-4 weights within 1e-2 absolute. Measured by hand on the 2-core machine:
loss 1.5e-6 relative, KL 0.5%, weights 5.6e-4 absolute (Adam's normalised update amplifies tiny gradient
differences). Six verl jobs, about 7 minutes."""

from __future__ import annotations

import shutil

import pytest
import torch

from relay.checkpoints import manifest
from relay.devstack import stack
from relay.jobs import local_head
from relay.runs import layout
from support.helpers import read_metrics, relay_cli
from support.verl_jobs import JOB_TIMEOUT, finish, full_model, relay_train, spec_variant, swap_rank_shards

pytestmark = pytest.mark.lane("verl")


def spec_at(path, checkpoint_dir, n_gpus: int, policy: str = "refuse"):
    # save_freq 1: a checkpoint at every step, step 1 to fall back to
    return spec_variant(path, checkpoint_dir, {"n_gpus_per_node": n_gpus, "save_freq": 1}, {"on_world_size_change": policy})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("verl_reshard")
    two = spec_at(base / "two.yaml", base / "at2", 2)
    one = spec_at(base / "one.yaml", base / "at1", 1, policy="reshard")
    run2, run1 = base / "at2" / "verl_tiny_cpu", base / "at1" / "verl_tiny_cpu"
    swap = base / "swapped" / "verl_tiny_cpu"
    with local_head.local_head(
        stack.ray_cli(), stack.ray_env(local_s3=False), num_cpus=stack.head_cpus(), num_gpus=2, avoid=stack.stack_ray_ports()
    ) as head:
        finish(relay_train(run2, 2, head.address, base / "c1.log", spec=two), base / "c1.log")
        shutil.copytree(run2, run1)
        shutil.copytree(run2, swap)
        finish(relay_train(run2, 4, head.address, base / "c2.log", spec=two), base / "c2.log")
        swapped = swap_rank_shards(swap, 2)
        refused_rc = relay_train(swap, 4, head.address, base / "swap.log", spec=two).wait(timeout=JOB_TIMEOUT)
        refused = (base / "swap.log").read_text(errors="replace")
        retried = finish(relay_train(swap, 4, head.address, base / "swap2.log", spec=two), base / "swap2.log")
    reshard = relay_cli("checkpoint", "reshard", str(run1), "--world-size", "1")
    assert reshard.returncode == 0, reshard.stdout + reshard.stderr
    with stack.private_ray_head() as head:  # one logical GPU, as `relay train` starts with nothing running
        log = finish(relay_train(run1, 4, head.address, base / "c2-at1.log", spec=one), base / "c2-at1.log")
    return {
        "two": run2,
        "one": run1,
        "log": log,
        "reshard": reshard.stdout,
        "swap": swap,
        "swapped": swapped,
        "refused_rc": refused_rc,
        "refused": refused,
        "retried": retried,
    }


def test_the_run_resharded_to_one_trains_on_like_the_run_that_stayed_at_two(runs):
    assert "resharded step 2 (FSDP2) from world size 2 to 1" in runs["reshard"]
    assert "resumes from step 2" in runs["log"] and "verl resumed at step 2" in runs["log"]
    m = manifest.read(layout.step_dir(runs["one"], 2))
    assert m.world_size == 1 and m.resharded_from["world_size"] == 2
    assert (layout.step_dir(runs["one"], 4) / "actor" / "model_world_size_1_rank_0.pt").is_file()
    a = {r["step"]: r for r in read_metrics(runs["two"])}
    b = {r["step"]: r for r in read_metrics(runs["one"])}
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert a[step]["sample_indices"] == b[step]["sample_indices"] and a[step]["lr"] == b[step]["lr"]
        assert a[step]["reward_mean"] == b[step]["reward_mean"], "the same weights generate the same answers"
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5, abs=1e-7)
        assert b[step]["kl"] == pytest.approx(a[step]["kl"], rel=2e-2)
    wa, wb = full_model(layout.step_dir(runs["two"], 4), 2), full_model(layout.step_dir(runs["one"], 4), 1)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-2


def test_the_resharded_resume_is_certified_within_the_tolerance(runs):
    """World size 2 -> 1: every parameter's digest is the same at any sharding (exact), the probe within
    checkpoints.certificate_tolerance, and the log says by how much."""
    import re

    m = re.search(r"certified resume from step 2: probe log-probs differ by at most (\S+) \(within 0.001\)", runs["log"])
    assert m, runs["log"][-4000:]
    assert float(m.group(1)) <= 1e-3


def test_two_ranks_shards_swapped_are_refused_by_the_certificate_and_the_run_falls_back(runs):
    from relay.runs.metrics import read_events

    assert runs["swapped"], "some parameters' two pieces have one shape"
    assert runs["refused_rc"] != 0
    assert "certificate does not hold" in runs["refused"] and "parameters hold other values" in runs["refused"]
    [event] = [e for e in read_events(runs["swap"]) if e["event"] == "certificate_refused"]
    assert event["step"] == 2 and event["fell_back_to"] == 1
    assert "certified resume from step 1: probe log-probs differ by at most 0 (exact)" in runs["retried"]
    a = {r["step"]: r for r in read_metrics(runs["two"])}
    b = {r["step"]: r for r in read_metrics(runs["swap"])}
    for step in (2, 3, 4):
        assert (a[step]["sample_indices"], a[step]["lr"]) == (b[step]["sample_indices"], b[step]["lr"])
    wa, wb = full_model(layout.step_dir(runs["two"], 4), 2), full_model(layout.step_dir(runs["swap"], 4), 2)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "trained again from step 1: step 4 is the same bits"


@pytest.fixture(scope="module")
def grown(runs, tmp_path_factory):
    """The run resharded to world size 1 (steps 3 and 4 trained there) copied, its step 4 resharded to world size 2
    (`relay checkpoint reshard`'s code) and its two ranks' model pieces swapped; `relay train` of the copy at world
    size 2 (checkpoints.on_world_size_change: reshard) to step 5, then to step 4."""
    from relay.checkpoints.reshard import reshard
    from relay.runs.metrics import read_events

    base = tmp_path_factory.mktemp("verl_grown")
    run = base / "grown" / "verl_tiny_cpu"
    shutil.copytree(runs["one"], run)
    reshard(run, 2, step=4)
    names = swap_rank_shards(run, 4)
    spec = spec_at(base / "grown.yaml", base / "grown", 2, policy="reshard")
    with local_head.local_head(
        stack.ray_cli(), stack.ray_env(local_s3=False), num_cpus=stack.head_cpus(), num_gpus=2, avoid=stack.stack_ray_ports()
    ) as head:
        refused_rc = relay_train(run, 5, head.address, base / "refused.log", spec=spec).wait(timeout=JOB_TIMEOUT)
        tracker_after = layout.read_tracker(run)
        retried = finish(relay_train(run, 4, head.address, base / "retried.log", spec=spec), base / "retried.log")
    return {
        "run": run,
        "names": names,
        "refused_rc": refused_rc,
        "refused": (base / "refused.log").read_text(errors="replace"),
        "refusals": [e for e in read_events(run) if e["event"] == "certificate_refused"],
        "tracker_after": tracker_after,
        "retried": retried,
    }


def test_a_refused_resume_at_a_new_world_size_falls_back_and_relay_train_reshards_the_fallback_step(runs, grown):
    """verl's trainer at world size 2 loads the swapped step 4 and its workers' certificate refuses it: quarantined, the
    tracker back at step 3 (saved at world size 1); the next `relay train` reshards step 3 to world size 2, resumes
    from it certified within the tolerance, and trains step 4 as the run at world size 1 did (the same data order,
    LR and rewards; the weights within 1e-2: two ranks sum their gradients in another order)."""
    assert grown["names"], "some parameters' two pieces have one shape"
    log = grown["refused"]
    assert grown["refused_rc"] != 0, log[-6000:]
    assert "certificate does not hold" in log and "parameters hold other values" in log, log[-6000:]
    [event] = grown["refusals"]
    assert (event["step"], event["fell_back_to"], grown["tracker_after"]) == (4, 3, 3)
    assert "certified resume from step 3" in grown["retried"], grown["retried"][-6000:]
    assert layout.read_tracker(grown["run"]) == 4
    a = {r["step"]: r for r in read_metrics(runs["one"])}
    b = {r["step"]: r for r in read_metrics(grown["run"])}
    assert (a[4]["sample_indices"], a[4]["lr"], a[4]["reward_mean"]) == (
        b[4]["sample_indices"],
        b[4]["lr"],
        b[4]["reward_mean"],
    )
    wa, wb = full_model(layout.step_dir(runs["one"], 4), 1), full_model(layout.step_dir(grown["run"], 4), 2)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-2
