"""verl's `cpu` platform (relay.trainers.verl_ppo.cpu.platform), as a verl process sees it: chosen by
VERL_PLATFORM=cpu, imported by verl itself through VERL_USE_EXTERNAL_MODULES, with verl's own FSDP engines
and checkpoint manager on it. (The first piece of issue 15: verl's trainer on a CPU.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from relay.checkpoints.validate import validate_checkpoint
from relay.trainers.verl_ppo.cpu.tiny_model import make_tiny_model
from relay.trainers.verl_ppo.verl_contract import CPU_PLATFORM_ENV as ENV
from support import verl_checkpoint
from support.helpers import ROOT
from support.ports import free_port

pytestmark = pytest.mark.processes  # verl's engine on the cpu platform, in processes of its own: not in the fast lane

PROBE = """
import json, warnings
warnings.filterwarnings("ignore")
import verl  # imports VERL_USE_EXTERNAL_MODULES first, as in every verl worker
from omegaconf import OmegaConf
from verl.plugin.platform import get_platform
from verl.utils import device
from verl.workers.engine.base import EngineRegistry

out = {"platform": type(get_platform()).__name__, "device": device.get_device_name(),
       "backend": device.get_nccl_backend(), "ray_resource": device.get_resource_name()}
if out["device"] == "cpu":
    torch_device = device.get_torch_device()
    torch_device.empty_cache(); torch_device.synchronize(); torch_device.set_device(0)
    free, total = torch_device.mem_get_info()
    out["memory"] = torch_device.memory_reserved() > 0 and 0 < free <= total
    state = torch_device.get_rng_state(); torch_device.set_rng_state(state)
    out["engines"] = sorted({EngineRegistry.get_engine_cls(m, b).__name__
                             for m in ("language_model", "value_model") for b in ("fsdp", "fsdp2")})
    config = OmegaConf.create({"trainer": {"device": "cpu"}})
    device.auto_set_device(config)  # what Relay's verl driver calls on the composed config
    out["trainer.device"] = config.trainer.device
print(json.dumps(out))
"""


def probe(env: dict) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    r = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, "VERL_LOGGING_LEVEL": "WARN", **env},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_job_environment_with_the_cpu_platform_runs_verl_on_the_cpu():
    assert importlib.util.find_spec(ENV["VERL_USE_EXTERNAL_MODULES"]) is not None, "the module the job names"
    got = probe(ENV)
    assert got == {
        "platform": "PlatformCPU",
        "device": "cpu",
        "backend": "gloo",
        "ray_resource": "GPU",
        "memory": True,
        "engines": ["FSDPEngineWithLMHead", "FSDPEngineWithValueHead"],
        "trainer.device": "cpu",
    }


def test_the_cpu_platform_is_never_picked_without_being_asked_for():
    """Imported but not named: verl's own detection runs (a CPU box falls back to nvidia, as before)."""
    got = probe({"VERL_USE_EXTERNAL_MODULES": ENV["VERL_USE_EXTERNAL_MODULES"]})
    assert got["platform"] != "PlatformCPU" and got["device"] != "cpu"


def test_verls_checkpoint_manager_on_the_cpu_platform_writes_checkpoints_that_pass_every_level(tmp_path, monkeypatch):
    for key, value in ENV.items():
        monkeypatch.setenv(key, value)  # the writer's gloo processes inherit it
    step_dir = verl_checkpoint.make(tmp_path / "run", step=2, world_size=2, fsdp=2)
    report = validate_checkpoint(tmp_path / "run", 2)
    assert report.ok, report.summary()
    assert (step_dir / "actor" / "model_world_size_2_rank_1.pt").is_file()


def test_verls_fsdp_engine_builds_steps_saves_and_loads_the_tiny_model_on_the_cpu(tmp_path):
    """verl's FSDP engine, as verl's workers build it (EngineRegistry.new), on the cpu platform: one step of
    verl's optimizer_step moves the weights, and a fresh engine loads them back bitwise from its checkpoint."""
    model = make_tiny_model(tmp_path / "model")
    ckpt = tmp_path / "run" / "global_step_1" / "actor"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "verl_engine_cpu.py"), str(model), str(ckpt), str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        env={**clean, "VERL_LOGGING_LEVEL": "WARN", **ENV},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert got["engine"] == got["fresh_engine"] == "FSDPEngineWithLMHead" and got["device"] == "cpu"
    assert got["grad_norm"] > 0 and got["lr"] == 0.01 and "lm_head.weight" in got["moved"]
    assert (ckpt / "model_world_size_1_rank_0.pt").is_file() and (ckpt / "optim_world_size_1_rank_0.pt").is_file()
    assert got["fresh_differs"], "a fresh engine starts from the model's own weights"
    assert got["equal"], "the weights loaded by a fresh engine are the ones saved"
