"""Settings of the CPU GRPO trainer, as written under `trainer.settings` in a run spec.

Imports only pydantic, so a spec can be validated where torch is not installed (the DAG processor).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from relay.spec.kinds import CoreSettings
from relay.spec.model import StrictModel, critical
from relay.trainers.batches import BatchedSettings


class ModelSettings(StrictModel):
    """A tiny Qwen2 decoder built from its config: no download."""

    hidden_size: int = Field(64, gt=0, description="width of the model")
    intermediate_size: int = Field(128, gt=0, description="width of its MLP")
    num_hidden_layers: int = Field(2, gt=0, description="decoder layers")
    num_attention_heads: int = Field(4, gt=0, description="attention heads")
    num_key_value_heads: int = Field(2, gt=0, description="key/value heads (grouped-query attention)")


class OptimSettings(StrictModel):
    lr: float = Field(3e-3, gt=0, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's weight decay")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description=(
            "constant: verl's constant schedule with warmup; cosine: verl's cosine with warmup, its horizon the run's "
            "total_steps"
        ),
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine: the LR's floor, as a share of lr")


class RewardFunctionSettings(StrictModel):
    """verl's `custom_reward_function`: a Python file and the function in it that scores a response,
    called as verl calls it: name(data_source, solution_str, ground_truth, extra_info) -> float. This
    trainer's extra_info: the row's split and index, and the global step being trained."""

    path: str | None = Field(
        None, description="the .py file (relative paths: to the project root); empty: the task's own rule-based reward"
    )
    name: str = Field("compute_score", description="the function in that file")


class TinyGRPOSettings(BatchedSettings):
    """GRPO on a synthetic, verifiable arithmetic task ("3+4=" -> "7")."""

    WORLD_SIZE_KEYS: ClassVar[tuple[str, ...]] = ("world_size",)

    model: ModelSettings = critical(default_factory=ModelSettings, description="the tiny Qwen2 built from its config")
    optim: OptimSettings = critical(default_factory=OptimSettings, description="the optimizer and LR schedule")
    adv_estimator: Literal["grpo", "rloo"] = critical("grpo", description="verl's advantage estimator")
    train_batch_size: int = critical(16, gt=0, description="prompts per step")
    rollout_n: int = critical(8, ge=2, description="GRPO group size: responses per prompt")
    ppo_mini_batch_size: int = critical(8, gt=0, description="prompts per optimizer step")
    max_response_length: int = critical(3, gt=0, description="tokens generated per response")
    temperature: float = critical(1.0, gt=0, description="sampling temperature of the rollout")
    clip_ratio: float = critical(0.2, gt=0, description="PPO's clip range")
    use_kl_loss: bool = critical(True, description="a KL loss against the reference model")
    kl_loss_coef: float = critical(0.001, ge=0, description="its weight")
    kl_loss_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = critical(
        "low_var_kl", description="verl's KL estimator"
    )
    total_epochs: int = critical(1, gt=0, description="passes over the training data")
    shuffle: bool = critical(True, description="shuffle the data each epoch (seeded by the run's seed)")
    fsdp_version: Literal[1, 2] = critical(2, description="the FSDP layout its checkpoints are written in")
    world_size: int = critical(
        1, ge=1, description="FSDP world size; its shard names carry it (this trainer runs one gloo process: 1)"
    )
    custom_reward_function: RewardFunctionSettings = critical(
        default_factory=RewardFunctionSettings, description="the reward, as verl's custom_reward_function"
    )
    save_freq: int = Field(0, ge=0, description="also save every N steps inside a chunk (0: only at the chunk's end)")

    def core(self) -> CoreSettings:
        """What the core reads: saves, the FSDP layout and world size of its checkpoints, the rows of a step."""
        return CoreSettings(
            save_freq=self.save_freq,
            world_size=self.world_size,
            fsdp_version=self.fsdp_version,
            batch_rows=self.train_batch_size,
        )

    @property
    def has_critic(self) -> bool:
        """GRPO has no critic: its checkpoints hold actor/ only (GAE-based PPO adds critic/)."""
        return False
