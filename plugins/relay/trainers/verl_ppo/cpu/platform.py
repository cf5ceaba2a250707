"""verl's `cpu` platform: device `cpu`, collectives over `gloo`, registered in verl's PlatformRegistry.

verl 0.9.1 picks its platform in `verl/plugin/platform/platform_manager.py`: `VERL_PLATFORM` names it,
else the first registered platform whose hardware is found, else `nvidia` (so a CPU box counts as CUDA).
Only nvidia, huawei and amd are registered. A job that should train on CPUs sets

    VERL_PLATFORM=cpu
    VERL_USE_EXTERNAL_MODULES=relay.trainers.verl_ppo.cpu.platform

in its environment (verl_contract.CPU_PLATFORM_ENV): `import verl` imports this module in every process
that imports verl (the driver, the TaskRunner actor, each worker), which registers the platform before
anything asks for it.

Ray: verl asks Ray for its workers' accelerators by the platform's resource name and checks the
cluster's `GPU` count before it builds a resource pool (`verl/single_controller/ray/base.py`,
`_check_resource_available`). On a CPU node those are logical GPUs: a Ray head started with
`--num-gpus=N` hands them out without any device behind them, and CUDA_VISIBLE_DEVICES, which Ray sets
for such actors, is read by nothing on a CPU.

This module imports verl and torch at the top: it is only ever imported by verl itself (above) or by a
process that is about to run verl.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from relay.trainers.verl_ppo.cpu import device as cpu_device
from relay.trainers.verl_ppo.cpu import patches as cpu_patches
from relay.trainers.verl_ppo.verl_contract import CPU_PLATFORM as PLATFORM
from relay.trainers.verl_ppo.verl_contract import HF_AGENT_LOOP, HF_ROLLOUT


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """verl on a CPU: one device per process, gloo between processes, no profiler, no IPC."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return cpu_device

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        # Never auto-detected: a CPU is everywhere, so it is chosen only by VERL_PLATFORM=cpu.
        return False

    def current_device(self) -> Any:
        # verl passes get_device_id() to .to() and device= as "this process's accelerator"; on a CPU that is
        # the CPU itself (an index 0 would ask torch for an accelerator that is not there).
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass  # one device

    def synchronize(self, device_index: int | None = None) -> None:
        pass  # CPU kernels are done when they return

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass  # CUDA's caching-allocator settings (expandable segments) mean nothing here

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None  # no compute capability: verl then picks no capability-gated kernel

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # what Ray sets for an actor holding logical GPUs (see the docstring)

    def ray_resource_name(self) -> str:
        return "GPU"  # logical GPUs on a CPU node: verl's resource pools count these (see the docstring)

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False  # weights reach the rollout by copy, not through CUDA IPC handles

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def cudart(self) -> Any:
        return None


def register_fsdp_engines() -> None:
    """verl's own FSDP engines (actor and critic), registered for device `cpu` too. verl registers them for
    cuda and npu only (`verl/workers/engine/fsdp/transformer_impl.py`, `@EngineRegistry.register(...,
    device=["cuda", "npu"])`); the classes run on a CPU as they are, over gloo."""
    # verl says, in every process, which of its optional engines (Megatron, torchtitan...) it could not import;
    # the CPU path uses its FSDP engine only.
    warnings.filterwarnings("ignore", message=r".* engine is not available", category=UserWarning)
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, cls in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        try:
            EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device=PLATFORM)(cls)
        except AssertionError:  # verl's register() asserts a key is new: this process registered them already
            pass


def register_hf_rollout() -> None:
    """The `hf` rollout (relay.trainers.verl_ppo.cpu.hf_rollout: transformers in the hybrid worker), named in
    verl's two rollout registries: the adapter a worker builds (`_ROLLOUT_REGISTRY`, by its path) and the
    replica the trainer launches (`RolloutReplicaRegistry`, by a loader); and its agent loop, which tags
    each request with its sample (verl's agent-loop registry). None is imported until used."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    base._ROLLOUT_REGISTRY[(HF_ROLLOUT, "async")] = "relay.trainers.verl_ppo.cpu.hf_rollout.HFServerAdapter"
    RolloutReplicaRegistry.register(HF_ROLLOUT, _hf_replica)
    # verl's agent-loop registry holds Hydra targets: naming the class imports nothing until a worker builds it.
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    _agent_loop_registry[HF_AGENT_LOOP] = {"_target_": "relay.trainers.verl_ppo.cpu.hf_rollout.RelaySingleTurnAgentLoop"}


def register_gloo_checkpoint_engine() -> None:
    """The `gloo` checkpoint engine (relay.trainers.verl_ppo.cpu.gloo_checkpoint_engine) in verl's CheckpointEngineRegistry:
    separate_async refuses the colocated `naive` engine, and verl's other engines need GPUs."""
    from relay.trainers.verl_ppo.cpu import gloo_checkpoint_engine

    gloo_checkpoint_engine.register_gloo_checkpoint_engine()


def _hf_replica() -> type:
    from relay.trainers.verl_ppo.cpu.hf_rollout import HFReplica

    return HFReplica


# At import: verl imports this module (VERL_USE_EXTERNAL_MODULES) before any worker builds an engine or a rollout.
register_fsdp_engines()
register_hf_rollout()
register_gloo_checkpoint_engine()
cpu_patches.apply()
