"""What every trainer kind that trains on batches of prompts shares in its settings: the mini-batch must divide
the batch, and the steps the data can supply, as verl counts them (pydantic only: a spec's validation imports it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import model_validator

from relay.spec.kinds import TrainerSettings


class BatchedSettings(TrainerSettings):
    """A kind's settings with verl's batch keys: `train_batch_size`, `ppo_mini_batch_size`, `total_epochs`
    (each kind declares them where its keys read best, with its own defaults)."""

    if TYPE_CHECKING:  # declared by each kind: as fields here, they would come first in its spec reference
        train_batch_size: int
        ppo_mini_batch_size: int
        total_epochs: int

    @model_validator(mode="after")
    def _mini_batch_divides(self) -> BatchedSettings:
        if self.train_batch_size % self.ppo_mini_batch_size:
            raise ValueError(
                f"ppo_mini_batch_size ({self.ppo_mini_batch_size}) must divide train_batch_size ({self.train_batch_size})"
            )
        return self

    def steps_available(self, train_rows: int) -> int:
        """Training steps the data can supply: full batches per epoch (drop_last) times epochs, as verl counts."""
        return (train_rows // self.train_batch_size) * self.total_epochs

    def data_budget(self) -> str:
        """The keys steps_available reads, with their values."""
        return f"train_batch_size {self.train_batch_size}, total_epochs {self.total_epochs}"


def resolved_settings(spec, train_rows: int | None, *, lr_schedule: str) -> dict:
    """What a batched trainer derives from the spec and would run with, beyond the spec's own keys (recorded with
    the run's settings, compared by the settings guard): its world size and FSDP layout, the LR's horizon, the
    rollouts of a step, the LR schedule in words, and the steps of an epoch."""
    s = spec.settings
    sizes = [o.world_size for o in s.core().world_options]  # elastic: the range the run may train at
    out = {
        "resolved.world_size": f"{min(sizes)}..{max(sizes)}" if sizes else s.world_size,
        "resolved.fsdp_version": s.fsdp_version,
        "resolved.lr_horizon": spec.total_steps,
        "resolved.rollouts_per_step": s.train_batch_size * s.rollout_n,
        "resolved.lr_schedule": lr_schedule,
    }
    if train_rows is not None:
        out["resolved.steps_per_epoch"] = train_rows // s.train_batch_size
    return out
