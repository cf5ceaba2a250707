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
