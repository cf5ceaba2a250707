"""The verl code that cannot run on a CPU as it is: each replacement, the verl line it replaces, and why.

Applied by relay.trainers.verl_ppo.cpu.platform when verl imports it (VERL_PLATFORM=cpu), so only in
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
   parameters already live in host memory, so the replacement builds the same policy unpinned. The same line for
   FSDP1 (transformer_impl.py:433, `CPUOffload(offload_params=True)`, the name imported from
   `torch.distributed.fsdp` at each build) makes torch pin the flat parameter's host copy at the first forward,
   alike: in the CPU platform's processes that name is a subclass that offloads nothing (the parameters stay in
   host memory all the same).
3. torch/distributed/fsdp/_init_utils.py (`_check_module_states_for_sync_module_states`, torch's FSDP1, a
   torch-private function): verl's FSDP1 engines always wrap with `sync_module_states=True`
   (verl/workers/engine/fsdp/transformer_impl.py:444, `_build_fsdp_module`), so that ranks above 0 get rank
   0's weights by a broadcast; torch refuses that broadcast for CPU tensors ("requires them to be on GPU"), though
   gloo broadcasts CPU tensors. Turning the sync off would leave those ranks with their own initial weights (a
   certificate would then certify them), so the replacement lifts the check only: torch's broadcast runs as it is.
4. verl/utils/fsdp_utils.py:229 (`load_fsdp_model_to_gpu`, FSDP1): moves each flat parameter to
   `torch.device(f"{get_device_name()}:{device_id}")`, which on the CPU platform reads "cpu:cpu" (the platform's
   current device is the CPU itself); torch refuses it ("Invalid device string"). An FSDP1 model on a CPU is
   already where that call would move it, so the replacement only lazily initialises the root as verl's does;
   FSDP2 models go to verl's own function.
5. verl/utils/model.py:641 (`load_valuehead_model`, the critic's value model where the algorithm has one): loads
   with `attn_implementation="flash_attention_2"` whatever the spec says, and flash-attn needs CUDA. The
   replacement loads the same class (`AutoModelForTokenClassification`, verl's first choice) with torch's sdpa.
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

    _replace_everywhere("initialize_global_process_group_ray", original, initialize_global_process_group_ray)
    import verl.workers.engine.fsdp.transformer_impl as fsdp_engine

    policy = fsdp_engine.CPUOffloadPolicy
    if policy is not None:

        def unpinned_cpu_offload_policy(pin_memory: bool = True):
            return policy(pin_memory=False)  # an instance of torch's own class: isinstance checks still hold

        fsdp_engine.CPUOffloadPolicy = unpinned_cpu_offload_policy
    import torch.distributed.fsdp as fsdp1

    class CPUOffloadInPlace(fsdp1.CPUOffload):
        """torch's FSDP1 CPUOffload that offloads nothing: the parameters are in host memory already."""

        def __init__(self, offload_params: bool = False) -> None:
            super().__init__(offload_params=False)

    # verl's engine imports the name inside _build_fsdp_module, from torch's package, at every build
    fsdp1.CPUOffload = CPUOffloadInPlace
    _allow_fsdp1_sync_of_cpu_states()
    _keep_fsdp1_models_on_the_cpu()
    _value_model_with_sdpa()
    _APPLIED = True


def _value_model_with_sdpa() -> None:
    """Patch 5: the critic's value model built with torch's sdpa attention."""
    import verl.utils.model as verl_model

    original = verl_model.load_valuehead_model

    @functools.wraps(original)
    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation="sdpa",
            trust_remote_code=False,  # Relay runs no model repository's code (docs/SECURITY.md)
        )

    _replace_everywhere("load_valuehead_model", original, load_valuehead_model)


def _replace_everywhere(name: str, original, replacement) -> None:
    """verl's function `name` replaced in every verl module that holds it (those that imported the name before
    this ran keep verl's function otherwise). verl's modules only, read through __dict__: a lazy module's
    getattr would import things."""
    for mod_name, module in list(sys.modules.items()):
        if (mod_name == "verl" or mod_name.startswith("verl.")) and vars(module).get(name) is original:
            setattr(module, name, replacement)


def _keep_fsdp1_models_on_the_cpu() -> None:
    """Patch 4: an FSDP1 model is not moved to "cpu:cpu"."""
    import verl.utils.fsdp_utils as fsdp_utils
    from torch.distributed.fsdp._runtime_utils import _lazy_init

    original = fsdp_utils.load_fsdp_model_to_gpu

    @functools.wraps(original)
    def load_fsdp_model_to_gpu(model):
        if fsdp_utils.fsdp_version(model) != 1:
            return original(model)
        _lazy_init(model, model)  # as verl's does first; its parameters are on the CPU already
        return None

    _replace_everywhere("load_fsdp_model_to_gpu", original, load_fsdp_model_to_gpu)


def _allow_fsdp1_sync_of_cpu_states() -> None:
    """Patch 3: torch's FSDP1 broadcasts rank 0's CPU parameters over gloo instead of refusing them."""
    import torch.distributed.fsdp._init_utils as fsdp1_init

    def _check_module_states_for_sync_module_states(module_states) -> None:
        return None  # the broadcast that follows (torch's _sync_params_and_buffers) is gloo's, on the CPU

    fsdp1_init._check_module_states_for_sync_module_states = _check_module_states_for_sync_module_states
