"""What Relay relies on in verl's own code, and the error when verl changed under it.

A leaf module (nothing of Relay's verl_ppo is imported here), so that the horizon check, the task
runner and the chunk trainer can all use it without importing each other.
"""

from __future__ import annotations

from relay.common.errors import RelayError

# verl's CPU path (relay.trainers.verl_ppo.cpu_platform): the environment a job sets so that every verl
# process picks the `cpu` platform (verl/plugin/platform/platform_manager.py reads VERL_PLATFORM) and
# imports the module that registers it (verl/__init__.py imports VERL_USE_EXTERNAL_MODULES). Kept here,
# in a light module, so that whoever builds a job's environment does not import verl.
CPU_PLATFORM = "cpu"
HF_ROLLOUT = "hf"  # the rollout that generates with transformers in verl's hybrid worker (hf_rollout.py)
HF_AGENT_LOOP = "relay_single_turn_agent"  # its agent loop: verl's single-turn one, requests tagged by sample
CPU_PLATFORM_ENV = {"VERL_PLATFORM": CPU_PLATFORM, "VERL_USE_EXTERNAL_MODULES": "relay.trainers.verl_ppo.cpu_platform"}


class VerlContractError(RelayError):
    """verl's trainer lookup changed: Relay cannot put its chunk trainer where verl looks for it."""

    exit_code = 2
    retry_helps = False


def original_class(actor_class) -> type:
    """The plain class under a @ray.remote actor class (Ray keeps it as __ray_actor_class__)."""
    modified = actor_class.__ray_metadata__.modified_class
    cls = getattr(modified, "__ray_actor_class__", None)
    if not isinstance(cls, type) or not callable(getattr(cls, "run", None)):
        raise TypeError(f"{actor_class!r} does not wrap a class with run()")
    return cls
