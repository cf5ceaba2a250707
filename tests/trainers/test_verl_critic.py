"""verl with a critic (`adv_estimator: gae`: verl's value model, trained beside the actor) on Relay's CPU platform
(the value model with torch's sdpa: relay.trainers.verl_ppo.cpu.patches, patch 5). verl's lane
(`./scripts/test.sh --verl`): include/runs/verl_tiny_cpu.yaml with `adv_estimator: gae` and saves off the critical
path (`checkpoints.async_save`, in the critic's workers too) trains chunk 1 (0 -> 2);
its certificate holds the critic's parameters and optimizer moments, and the resume (2 -> 3) is certified with
them; a copy of step 2 whose critic weights were altered consistently (two rows swapped, the shard re-saved by
torch, the manifest removed) is refused at the resume, naming the critic's parameter."""

from __future__ import annotations

import shutil

import pytest
import torch

from relay.checkpoints import certificate
from relay.devstack import stack
from relay.runs import layout
from relay.runs.metrics import read_events
from support.verl_jobs import JOB_TIMEOUT, finish, relay_train, spec_variant

pytestmark = pytest.mark.lane("verl")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("verl_critic")
    # saves off the critical path: the critic's workers copy and write their shards as the actor's do
    spec = spec_variant(base / "gae.yaml", base / "runs", {"adv_estimator": "gae"}, {"async_save": True})
    run, altered = base / "runs" / "verl_tiny_cpu", base / "altered" / "verl_tiny_cpu"
    with stack.private_ray_head() as head:
        first = finish(relay_train(run, 2, head.address, base / "c1.log", spec=spec), base / "c1.log")
        shutil.copytree(run, altered)
        key = swap_critic_rows(layout.step_dir(altered, 2))
        resumed = finish(relay_train(run, 3, head.address, base / "c2.log", spec=spec), base / "c2.log")
        refused_rc = relay_train(altered, 3, head.address, base / "altered.log", spec=spec).wait(timeout=JOB_TIMEOUT)
    return {
        "run": run,
        "first": first,
        "resumed": resumed,
        "key": key,
        "refused_rc": refused_rc,
        "refused": (base / "altered.log").read_text(errors="replace"),
    }


def swap_critic_rows(step_dir) -> str:
    shard = step_dir / "critic" / layout.shard_name("model", 1, 0)
    sd = torch.load(shard, weights_only=False)
    key = next(k for k in sd if k.endswith("mlp.down_proj.weight"))
    local = sd[key].to_local() if hasattr(sd[key], "to_local") else sd[key]
    local[[0, 1]] = local[[1, 0]]
    torch.save(sd, shard)
    (step_dir / "relay_manifest.json").unlink(missing_ok=True)
    return key


def test_the_certificate_holds_the_critic_and_a_resume_is_certified_with_it(runs):
    saved = certificate.read(layout.step_dir(runs["run"], 2))
    assert saved.critic and saved.critic_optimizer, "the critic's parameters and moments are certified"
    assert any(k.endswith(".exp_avg_sq") for k in saved.critic_optimizer)
    assert "the critic's" in runs["first"]
    assert "of host buffers (actor and critic) allocated before the first step" in runs["first"], runs["first"][-3000:]
    checks = [(e["step"], e["certificate"]) for e in read_events(runs["run"]) if e["event"] == "resume_certificate"]
    assert checks == [(2, "certified")] and "certified resume from step 2" in runs["resumed"]
    assert layout.read_tracker(runs["run"]) == 3


def test_a_critic_altered_consistently_is_refused_at_the_resume(runs):
    out = runs["refused"]
    assert runs["refused_rc"] != 0, out[-4000:]
    assert "critic parameters hold other values than saved" in out and runs["key"] in out, out[-4000:]
