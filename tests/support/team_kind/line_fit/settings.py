"""Its settings: the kind's own keys, and what Relay's core reads of them (core())."""

from pydantic import Field

from relay.spec.kinds import CoreSettings, TrainerSettings
from relay.spec.model import critical


class LineFitSettings(TrainerSettings):
    batch_size: int = critical(8, gt=0, description="rows per step")
    lr: float = critical(0.01, gt=0, description="SGD's learning rate")
    save_freq: int = Field(0, ge=0, description="also save every N steps inside a chunk")

    def core(self) -> CoreSettings:
        return CoreSettings(save_freq=self.save_freq, world_size=1, fsdp_version=2)
