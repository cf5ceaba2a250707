"""What Relay relies on in verl's own code, and the error when verl changed under it.

A leaf module (nothing of Relay's verl_ppo is imported here), so that the horizon check, the task
runner and the chunk trainer can all use it without importing each other.
"""

from __future__ import annotations

from relay.common.errors import RelayError


class VerlContractError(RelayError):
    """verl's trainer lookup changed: Relay cannot put its chunk trainer where verl looks for it."""

    exit_code = 2


def original_class(actor_class) -> type:
    """The plain class under a @ray.remote actor class (Ray keeps it as __ray_actor_class__)."""
    modified = actor_class.__ray_metadata__.modified_class
    cls = getattr(modified, "__ray_actor_class__", None)
    if not isinstance(cls, type) or not callable(getattr(cls, "run", None)):
        raise TypeError(f"{actor_class!r} does not wrap a class with run()")
    return cls
