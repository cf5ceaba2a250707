"""The verl code that cannot run on a CPU as it is: each replacement, the verl line it replaces, and why.

Applied by relay.trainers.verl_ppo.cpu_platform when verl imports it (VERL_PLATFORM=cpu), so only in
processes that run verl on the CPU platform; a GPU job never imports this module. Each patch is the
smallest change that lets verl's own code go on; docs/gpu-cluster.md lists them.

1. verl/utils/distributed.py:89 (`initialize_global_process_group_ray`, called by every training worker,
   verl/workers/engine_workers.py:89): the default backend string is
   f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}", which on the CPU platform reads
   "cpu:gloo,cpu:gloo"; torch refuses a device named twice ("Duplicate device type cpu"). The
   replacement passes "cpu:gloo" when no backend is given; verl's own function does the rest.
2. verl/workers/engine/fsdp/transformer_impl.py:462 (`_build_fsdp_module`, FSDP2): a forward-only model
   (the reference policy) always gets `CPUOffloadPolicy(pin_memory=True)`; pinning host memory asks
   torch for an accelerator ("Cannot access accelerator device when none is available"). On a CPU the
   parameters already live in host memory, so the replacement builds the same policy unpinned.
"""

from __future__ import annotations

import functools
import sys

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    import verl.utils.distributed as dist

    original = dist.initialize_global_process_group_ray

    @functools.wraps(original)
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "cpu:gloo")

    # Modules that imported the name before this ran keep verl's function: patch them too.
    # (verl's modules only, read through __dict__: a lazy module's getattr would import things)
    for name, module in list(sys.modules.items()):
        if name.startswith("verl.") and vars(module).get("initialize_global_process_group_ray") is original:
            setattr(module, "initialize_global_process_group_ray", initialize_global_process_group_ray)  # noqa: B010
    import verl.workers.engine.fsdp.transformer_impl as fsdp_engine

    policy = fsdp_engine.CPUOffloadPolicy
    if policy is not None:

        def unpinned_cpu_offload_policy(pin_memory: bool = True):
            return policy(pin_memory=False)  # an instance of torch's own class: isinstance checks still hold

        fsdp_engine.CPUOffloadPolicy = unpinned_cpu_offload_policy
    _APPLIED = True
