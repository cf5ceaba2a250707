"""Relay's TaskRunner: verl's own TaskRunnerV1, with the chunk trainer installed inside the actor.

verl's main_ppo looks its trainer class up inside TaskRunnerV1.run, which runs in a Ray actor: a
registration made in the job's driver is never seen there. RelayTaskRunner subclasses verl's
TaskRunnerV1 class (the class under Ray's actor wrapper) and, in the actor, before verl's run:
pops the chunk from the config, installs RelayChunkTrainer under "sync", and sets the tracking ids.
Everything else is verl's run(); verl's run_ppo() takes the runner class as a parameter for this.
"""

from __future__ import annotations

from typing import Any

from relay.common.errors import RelayError
from relay.trainers.verl_ppo import tracking, verl_chunk
from relay.trainers.verl_ppo.verl_contract import original_class

_PLAIN = None
_REMOTE: Any = None  # the ray.remote actor class


def relay_task_runner() -> type:
    """RelayTaskRunner, the plain class (built once per process: it imports verl)."""
    global _PLAIN
    if _PLAIN is not None:
        return _PLAIN
    from verl.trainer.main_ppo import TaskRunnerV1

    base: Any = original_class(TaskRunnerV1)  # a class only known at runtime: mypy takes it as Any

    class RelayTaskRunner(base):
        """verl's TaskRunnerV1 for one Relay chunk: the trainer is installed here, in the actor."""

        def run(self, config):
            from relay.trainers.verl_ppo import chunk_trainer  # imports verl's trainer: in the actor only

            chunk = verl_chunk.detach(config)
            if chunk is None:
                raise RelayError(
                    "verl's config carries no Relay chunk", "start main_ppo through Relay's entrypoint", retry_helps=False
                )
            chunk_trainer.install(chunk)
            tracking.apply_env(chunk.tracking_env)
            return super().run(config)

    _PLAIN = RelayTaskRunner
    return _PLAIN


def task_runner_class():
    """The Ray actor class verl's run_ppo() starts (built on first use; it imports verl and ray)."""
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(relay_task_runner())
    return _REMOTE
