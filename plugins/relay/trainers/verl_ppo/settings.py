"""Settings of the production trainer (verl's main_ppo), as written under `trainer.settings` in a run spec.

Imports only pydantic, so a spec can be validated where verl is not installed (the DAG processor).
Every key here becomes a Hydra override of verl's own ppo_trainer.yaml (see overrides.py); what a
spec does not name keeps verl's default. `overrides` passes any other key of verl's config through,
except the keys Relay owns (the loop bound, the horizon, the checkpoint folder, resume, saving).
"""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from relay.spec.kinds import CoreSettings, WorldOption
from relay.spec.model import StrictModel, critical
from relay.trainers.batches import BatchedSettings

# Hydra override keys Relay sets from the spec and the chunk; a spec's `overrides` may not name them.
RELAY_OWNED_KEYS = (
    "trainer.default_local_dir",
    "trainer.checkpoint_callback_class",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.save_freq",
    "trainer.total_training_steps",
    "trainer.total_epochs",
    "trainer.val_before_train",
    "trainer.test_freq",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.logger",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep",
    "trainer.remove_previous_ckpt_in_save",
    "trainer.del_local_ckpt_after_load",
    "trainer.default_hdfs_dir",
    "trainer.use_v1",
    "trainer.v1",
    "trainer.val_only",
    "trainer.device",
    "data.train_files",
    "data.val_files",
    "data.train_batch_size",
    "data.shuffle",
    "data.seed",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.train_max_samples",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.actor.optim",
    "actor_rollout_ref.actor.checkpoint.async_save",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.nnodes",
    "actor_rollout_ref.rollout.n_gpus_per_node",
    "actor_rollout_ref.rollout.checkpoint_engine.backend",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "algorithm.adv_estimator",
    "critic.optim.total_training_steps",
    "ray_kwargs.ray_init.address",
)
_OVERRIDE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)=(.*)$", re.DOTALL)


class VerlOptimSettings(StrictModel):
    """The actor's optimizer and LR schedule (verl's FSDPOptimizerConfig). The schedule's horizon is
    always the run's total_steps, whatever the chunk."""

    lr: float = Field(1e-6, gt=0, description="peak learning rate")
    lr_scheduler_type: Literal["constant", "cosine"] = Field("constant", description="verl's LR schedule, with warmup")
    lr_warmup_steps: int = Field(-1, description="absolute warmup steps; <= 0 uses lr_warmup_steps_ratio")
    lr_warmup_steps_ratio: float = Field(0.0, ge=0, le=1, description="warmup as a share of the run's total steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine: the LR's floor, as a share of lr")
    num_cycles: float = Field(0.5, gt=0, description="cosine: its cycles over the horizon (0.5: one decay)")
    weight_decay: float = Field(0.01, ge=0, description="AdamW's weight decay")
    clip_grad: float = Field(1.0, gt=0, description="gradient norm clipping")

    @property
    def horizon_dependent(self) -> bool:
        """Whether the LR at a step depends on the schedule's horizon (the total number of steps)."""
        return self.lr_scheduler_type == "cosine" or (self.lr_warmup_steps <= 0 and self.lr_warmup_steps_ratio > 0)


TrackingBackend = Literal["console", "wandb", "mlflow", "tensorboard", "file"]


class HFEngineSettings(StrictModel):
    """The hf rollout's timing (rollout_name hf, the CPU stand-in for an inference engine): how long each token
    takes and how long responses are, so that overlap, partial rollouts and the long tail happen as on GPUs."""

    token_latency_ms: float = Field(
        0.0,
        ge=0,
        le=10_000,
        description="each response is streamed one token per this many milliseconds (0: returned at once); an abort "
        "cuts it where it is, and the rest is generated after the resume under the weights of then",
    )
    response_lengths: Literal["model", "long_tail"] = Field(
        "model",
        description="model: as long as the model samples (to EOS or max_response_length); long_tail: each sample's "
        "length drawn from a Pareto tail (most short, a few at max_response_length), as reasoning models answer",
    )


def _console_only() -> list[TrackingBackend]:
    return ["console"]


class VerlPPOSettings(BatchedSettings):
    """verl's main_ppo (v1 sync, colocate_async or separate_async trainer) on a GPU Ray cluster, one Ray job per chunk
    or one supervised job."""

    WORLD_SIZE_KEYS: ClassVar[tuple[str, ...]] = ("nnodes", "n_gpus_per_node")

    mode: Literal["chunked", "supervised"] = Field(
        "chunked",
        description="chunked: one Ray job per chunk, each stops at the chunk's end step; supervised: "
        "one long job saving every chunk_steps, each chunk task waits for its checkpoint",
    )
    trainer_mode: Literal["sync", "colocate_async", "separate_async"] = critical(
        "sync",
        description="verl's v1 trainer: sync (generate, then train, each step), colocate_async (prompts handed out "
        "warmup_batches steps ahead, generated on the training GPUs between steps), separate_async (the same, "
        "generated on the rollout's own GPUs, which get the weights after every step through a checkpoint engine)",
    )
    warmup_batches: int = critical(
        1,
        ge=1,
        description="the async modes: batches handed out ahead of training (verl's num_warmup_batches); a step trains "
        "samples generated this many steps before it",
    )
    parameter_sync_step: int = critical(
        1,
        ge=1,
        description="separate_async: optimizer steps per training step, one mini-batch each (train_batch_size = "
        "parameter_sync_step x ppo_mini_batch_size); the rollout gets new weights once per training step",
    )
    resume_exactness: Literal["bitwise", "lossless"] | None = critical(
        None,
        description="the async modes: bitwise (every prompt generated in full under the weights it was handed out "
        "with, trained first in, first out: generation drained before each sample and weight change; resumes bit for "
        "bit, for CPU proofs and deterministic stacks) | lossless (verl's own overlap, selection and partial rollouts "
        "between saves: every prompt trained once or evicted with a recorded reason, staleness at most "
        "max_staleness); default lossless on cuda, bitwise on cpu (docs/gpu-cluster.md)",
    )
    max_staleness: int | None = critical(
        None,
        ge=2,
        description="lossless: the most policy versions a trained prompt may span, from the step that handed it out "
        "to the step that trains it (verl's max_off_policy_threshold); default warmup_batches + 1, the least",
    )
    stale_strategy: Literal["wait", "drop"] = critical(
        "wait",
        description="lossless: a prompt in flight at max_staleness holds the sampler until it is done (wait: none "
        "lost), or is evicted and replaced (drop: recorded in the prompt ledger with its reason)",
    )
    hf_engine: HFEngineSettings = Field(
        default_factory=lambda: HFEngineSettings.model_validate({}),
        description="rollout_name hf: the stand-in engine's timing",
    )
    rollout_nnodes: int = Field(1, ge=1, description="separate_async: nodes of the rollout's own GPUs")
    rollout_n_gpus_per_node: int = Field(
        1, ge=1, description="separate_async: the rollout's GPUs per node (one hf replica per GPU on a CPU)"
    )
    checkpoint_engine: Literal["gloo", "nccl", "nixl", "mooncake"] | None = Field(
        None,
        description="separate_async: how the weights reach the rollout's GPUs (verl's checkpoint engine); "
        "default nccl on cuda, gloo on cpu (Relay's, relay/trainers/verl_ppo/cpu/gloo_checkpoint_engine.py)",
    )
    model_path: str = critical(min_length=1, description="Hugging Face model folder on shared storage")
    tiny_model: bool = critical(
        False,
        description="make Relay's tiny Qwen2 model (relay model tiny: no download) "
        "at model_path when it is missing; for trials on a CPU",
    )
    device: Literal["cuda", "cpu"] = critical(
        "cuda",
        description="cpu: verl's trainer on CPUs through Relay's cpu platform (gloo, logical GPUs, "
        "rollout_name hf); cuda: a GPU cluster",
    )
    attn_implementation: Literal["flash_attention_2", "sdpa", "eager"] | None = critical(
        None,
        description="the model's attention; default: verl's (flash_attention_2, which needs flash-attn in "
        "the image) on cuda, sdpa on cpu",
    )
    rollout_name: Literal["vllm", "sglang", "hf"] = critical(
        "vllm", description="vllm | sglang (GPU engines) | hf: transformers' generate(), for the tiny model on a CPU"
    )
    fsdp_version: Literal[1, 2] = critical(2, description="1: strategy fsdp, 2: fsdp2")
    nnodes: int | tuple[int, int] = critical(
        1,
        description="nodes of the training world (world size = nnodes x n_gpus_per_node); [min, max]: elastic, each "
        "chunk's cold start takes the largest world size the Ray cluster holds then (docs/guides/elastic.md)",
    )
    n_gpus_per_node: int | tuple[int, int] = critical(8, description="GPUs per node; [min, max]: elastic, as nnodes")
    adv_estimator: str = critical("grpo", min_length=1, description="verl's algorithm.adv_estimator (gae has a critic)")
    rollout_n: int = critical(5, ge=1, description="responses per prompt")
    train_batch_size: int = critical(1024, gt=0, description="prompts per step")
    ppo_mini_batch_size: int = critical(256, gt=0, description="prompts per optimizer step")
    max_prompt_length: int = critical(512, gt=0, description="longest prompt, in tokens")
    max_response_length: int = critical(1024, gt=0, description="longest response, in tokens")
    temperature: float = critical(1.0, gt=0, description="sampling temperature of the rollout")
    clip_ratio: float = critical(0.2, gt=0, description="PPO's clip range")
    entropy_coeff: float = critical(0.0, ge=0, description="weight of the entropy bonus")
    use_kl_loss: bool = critical(True, description="a KL loss against the reference model")
    kl_loss_coef: float = critical(0.001, ge=0, description="its weight")
    kl_loss_type: str = critical("low_var_kl", description="verl's KL estimator")
    use_kl_in_reward: bool = critical(
        False, description="a KL penalty in the reward instead (verl's algorithm.use_kl_in_reward)"
    )
    total_epochs: int = critical(15, gt=0, description="passes over the training data")
    shuffle: bool = critical(True, description="shuffle the data each epoch (seeded by the run's seed)")
    optim: VerlOptimSettings = critical(
        default_factory=VerlOptimSettings, description="the actor's optimizer and LR schedule"
    )
    project_name: str | None = critical(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="tracking project; default relay-<spec name>"
    )
    experiment_name: str | None = critical(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="tracking experiment; default the run's name"
    )
    overrides: list[str] = critical(
        default_factory=list,
        description="more Hydra overrides of verl's config (key=value, keys that exist in verl's ppo_trainer.yaml)",
    )
    # Not resume-critical: speed and memory knobs, logging, validation, saving.
    ppo_micro_batch_size_per_gpu: int = Field(
        16, gt=0, description="samples per GPU per forward/backward (memory, not the math)"
    )
    log_prob_micro_batch_size_per_gpu: int = Field(32, gt=0, description="samples per GPU when computing log-probabilities")
    tensor_model_parallel_size: int = Field(2, ge=1, description="rollout tensor parallelism")
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1, description="share of each GPU the rollout engine takes")
    logger: list[TrackingBackend] = Field(default_factory=_console_only, description="verl's tracking backends")
    test_freq: int = Field(-1, description="validate every N steps (verl's test_freq); <= 0: only at the run's end")
    validate_every_chunk: bool = Field(
        False,
        description="also validate at every chunk's end (verl validates on "
        "its last step; only the run's real end does by default)",
    )
    val_before_train: bool = Field(True, description="validate before the first step (only ever in chunk 1)")
    save_freq: int = Field(
        0,
        ge=0,
        description="also save every N steps inside a chunk (0: at each chunk's "
        "end). In supervised mode it must divide chunk_steps",
    )
    ray_address: str = Field(
        "auto",
        min_length=1,
        description="what the job's ray.init attaches to: the cluster the job runs on ('auto'), never a new local one",
    )

    @field_validator("model_path")
    @classmethod
    def _model_path_is_plain(cls, v: str) -> str:
        if "${" in v or not v.startswith("/"):
            raise ValueError(
                "give the model's absolute path on shared storage (settings are not expanded, and verl "
                "would read ${...} as an interpolation)"
            )
        return v

    @field_validator("overrides")
    @classmethod
    def _overrides_are_plain(cls, v: list[str]) -> list[str]:
        for item in v:
            m = _OVERRIDE.match(item.strip())
            if not m:
                raise ValueError(
                    f"override {item!r} is not key=value with a key of verl's ppo_trainer.yaml (no +, ~ "
                    "or ++: every key must already exist in verl's config)"
                )
            key = m.group(1)
            owned = next(
                (k for k in RELAY_OWNED_KEYS if key == k or key.startswith(k + ".") or k.startswith(key + ".")), None
            )
            if owned:
                raise ValueError(
                    f"override {item!r} sets {owned}, which Relay sets from the spec and the chunk "
                    "(use the spec's own keys: total_steps, chunk_steps, checkpoint_dir, data, "
                    "trainer.settings)"
                )
        return v

    @field_validator("nnodes", "n_gpus_per_node")
    @classmethod
    def _count_or_range(cls, v: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (v, v) if isinstance(v, int) else v
        if low < 1 or high < low:
            raise ValueError(f"give a count of at least 1, or a range [min, max] with 1 <= min <= max (got {_text(v)})")
        return v

    @model_validator(mode="after")
    def _some_world_size_runs(self) -> VerlPPOSettings:
        if self.elastic and not self.world_options():
            raise ValueError(
                f"no world size in nnodes {_text(self.nnodes)} x n_gpus_per_node {_text(self.n_gpus_per_node)} runs "
                f"this batch: {'; '.join(self.refused_world_sizes())}; widen the range or change the batch sizes"
            )
        return self

    @model_validator(mode="after")
    def _cpu_rollout(self) -> VerlPPOSettings:
        if self.device == "cpu" and self.rollout_name != "hf":
            raise ValueError(
                f"device cpu generates with rollout_name hf (transformers in verl's worker); {self.rollout_name} needs GPUs"
            )
        if self.device == "cpu" and self.attn_implementation == "flash_attention_2":
            raise ValueError("flash_attention_2 needs a GPU: on device cpu use sdpa or eager")
        if self.rollout_name != "hf" and self.hf_engine != HFEngineSettings.model_validate({}):
            raise ValueError(
                f"hf_engine times the hf rollout (the CPU stand-in); rollout_name {self.rollout_name} is a real engine: "
                "remove hf_engine"
            )
        return self

    @model_validator(mode="after")
    def _trainer_mode(self) -> VerlPPOSettings:
        if self.trainer_mode == "separate_async":
            if self.train_batch_size != self.parameter_sync_step * self.ppo_mini_batch_size:
                raise ValueError(
                    f"separate_async trains parameter_sync_step mini-batches a step: train_batch_size "
                    f"({self.train_batch_size}) must equal parameter_sync_step ({self.parameter_sync_step}) x "
                    f"ppo_mini_batch_size ({self.ppo_mini_batch_size}); set parameter_sync_step to "
                    f"{self.train_batch_size // self.ppo_mini_batch_size}, or change the batch sizes"
                )
            if self.engine_for_weights == "gloo" and self.device != "cpu":
                raise ValueError("checkpoint_engine gloo is Relay's CPU engine: on cuda use nccl, nixl or mooncake")
            if self.engine_for_weights != "gloo" and self.device == "cpu":
                raise ValueError(f"checkpoint_engine {self.checkpoint_engine} needs GPUs: on device cpu use gloo")
        elif self.parameter_sync_step != 1:
            raise ValueError(f"parameter_sync_step is separate_async's; trainer_mode {self.trainer_mode} takes 1")
        if self.trainer_mode != "sync" and self.mode == "supervised":
            raise ValueError(f"trainer_mode {self.trainer_mode} runs in mode chunked (its chunks may go on warm)")
        if self.trainer_mode == "sync" and self.resume_exactness == "lossless":
            raise ValueError(
                "resume_exactness lossless is for the async modes (colocate_async, separate_async); trainer_mode sync "
                "generates each step's batch under its own weights and resumes bitwise: remove resume_exactness"
            )
        if self.max_staleness is not None and self.max_staleness < self.warmup_batches + 1:
            raise ValueError(
                f"max_staleness {self.max_staleness} is below warmup_batches + 1 ({self.warmup_batches + 1}): a prompt "
                f"handed out {self.warmup_batches} batch(es) ahead spans that many policy versions when it is trained; "
                f"set max_staleness to {self.warmup_batches + 1} or more"
            )
        return self

    @property
    def exactness(self) -> str:
        """How a resume of the async modes is exact: the spec's resume_exactness, else lossless on cuda and bitwise
        on cpu; the sync trainer is bitwise (relay.trainers.verl_ppo.async_trainer)."""
        if self.trainer_mode == "sync":
            return "bitwise"
        return self.resume_exactness or ("bitwise" if self.device == "cpu" else "lossless")

    @property
    def staleness_bound(self) -> int:
        """lossless: the most policy versions a trained prompt may span (verl's max_off_policy_threshold)."""
        return self.max_staleness or self.warmup_batches + 1

    @property
    def engine_for_weights(self) -> str:
        """separate_async's checkpoint engine: the spec's, else nccl on cuda and Relay's gloo engine on cpu."""
        return self.checkpoint_engine or ("gloo" if self.device == "cpu" else "nccl")

    @property
    def attention(self) -> str | None:
        """The attention implementation Relay asks verl for (None: verl's default)."""
        return self.attn_implementation or ("sdpa" if self.device == "cpu" else None)

    def core(self) -> CoreSettings:
        """What the core reads: saves, the actor's world size and FSDP layout (a world size must divide by the
        rollout's tensor parallel size), supervised mode, the async modes' prompts in flight, the GPUs a job holds."""
        return CoreSettings(
            save_freq=self.save_freq,
            world_size=self.world_size,
            fsdp_version=self.fsdp_version,
            world_size_divisor=self.tensor_model_parallel_size,
            supervised=self.mode == "supervised",
            prompts_in_flight=self.trainer_mode != "sync",
            logical_gpus=self.gpus,
            cpu_platform=self.device == "cpu",
            batch_rows=self.train_batch_size,
            critic=self.has_critic,
            world_options=tuple(self.world_options()) if self.elastic else (),
        )

    @property
    def elastic(self) -> bool:
        """nnodes or n_gpus_per_node is a range: each chunk's cold start picks its world size (relay.ops.elastic)."""
        return not (isinstance(self.nnodes, int) and isinstance(self.n_gpus_per_node, int))

    def world_options(self) -> list[WorldOption]:
        """The world sizes the ranges allow that verl can run this batch at, the largest first (fewer nodes first
        among equals), each with the placement groups it needs: verl's per node of the training pool (3 CPUs and 1
        GPU per worker, packed on one node) and separate_async's rollout replicas (2 CPUs per GPU)."""
        out = []
        rollout: list[tuple[float, float]] = []
        if self.trainer_mode == "separate_async":
            per = float(self.rollout_n_gpus_per_node)
            rollout = [(VERL_ROLLOUT_CPUS_PER_GPU * per, per)] * self.rollout_nnodes
        for nodes in _span(self.nnodes):
            for per_node in _span(self.n_gpus_per_node):
                if self.world_size_refused(nodes * per_node) is None:
                    groups = [(float(VERL_CPUS_PER_WORKER * per_node), float(per_node))] * nodes + rollout
                    out.append(WorldOption(nodes * per_node, nodes, per_node, tuple(groups)))
        return sorted(out, key=lambda o: (-o.world_size, o.nnodes))

    def world_size_refused(self, size: int) -> str | None:
        """Why verl cannot train this batch at world size `size` (None: it can): each rank takes an equal share of
        a step's responses and of each mini-batch's, and the rollout's tensor parallel groups tile the world."""
        responses, mini = self.train_batch_size * self.rollout_n, self.ppo_mini_batch_size * self.rollout_n
        if size % self.tensor_model_parallel_size:
            return f"{size}: not a multiple of tensor_model_parallel_size {self.tensor_model_parallel_size}"
        if responses % size or mini % size:
            return f"{size}: {responses} responses a step in mini-batches of {mini} do not split over {size} ranks"
        return None

    def refused_world_sizes(self) -> list[str]:
        """Every world size of the ranges verl cannot run, with why."""
        sizes = sorted({n * g for n in _span(self.nnodes) for g in _span(self.n_gpus_per_node)})
        return [why for size in sizes if (why := self.world_size_refused(size))]

    def at(self, world_size: int | None, nnodes: int | None = None) -> VerlPPOSettings:
        """These settings with nnodes and n_gpus_per_node set for one world size (an elastic spec's option, on
        `nnodes` nodes where given: a size may be made of more nodes or of more GPUs each; None: the largest); a fixed
        spec's own. A world size the spec does not allow is a ValueError."""
        if not self.elastic:
            if world_size not in (None, self.world_size):
                raise ValueError(f"the spec trains at world size {self.world_size}, not {world_size}")
            return self
        option = next(
            (o for o in self.world_options() if world_size in (None, o.world_size) and nnodes in (None, o.nnodes)), None
        )
        if option is None:
            allowed = ", ".join(str(o.world_size) for o in self.world_options())
            raise ValueError(f"world size {world_size} is not one of the spec's: {allowed}")
        return self.model_copy(update={"nnodes": option.nnodes, "n_gpus_per_node": option.gpus_per_node})

    @property
    def world_size(self) -> int:
        """The actor's FSDP world size (its shard names carry it: a change reshards the checkpoint); elastic: the
        largest allowed."""
        if self.elastic:
            return self.world_options()[0].world_size
        assert isinstance(self.nnodes, int) and isinstance(self.n_gpus_per_node, int)
        return self.nnodes * self.n_gpus_per_node

    def world_size_text(self) -> str:
        """The world size as the spec gives it: 8, or 8..16 (elastic)."""
        if not self.elastic:
            return str(self.world_size)
        sizes = [o.world_size for o in self.world_options()]
        return f"{min(sizes)}..{max(sizes)}"

    @property
    def gpus(self) -> int:
        """The GPUs a job holds: the training world, and separate_async's rollout on its own."""
        rollout = self.rollout_nnodes * self.rollout_n_gpus_per_node if self.trainer_mode == "separate_async" else 0
        return self.world_size + rollout

    @property
    def strategy(self) -> str:
        return "fsdp2" if self.fsdp_version == 2 else "fsdp"

    @property
    def has_critic(self) -> bool:
        """GAE needs a critic (critic/ in every checkpoint); GRPO, RLOO and the like do not."""
        return self.adv_estimator == "gae"


# verl's ResourcePoolManager: CPUs per training worker (max_colocate_count), and a standalone rollout replica's
# (verl/single_controller/ray/base.py, verl/workers/rollout/replica.py)
VERL_CPUS_PER_WORKER = 3
VERL_ROLLOUT_CPUS_PER_GPU = 2


def _span(v: int | tuple[int, int]) -> range:
    low, high = (v, v) if isinstance(v, int) else v
    return range(low, high + 1)


def _text(v: int | tuple[int, int]) -> str:
    return str(v) if isinstance(v, int) else f"[{v[0]}, {v[1]}]"


def unsaved_chunk_end(spec) -> str | None:
    """Why verl's save_freq would miss a chunk's end step (None: it saves each one). A job whose loop does not end at
    a chunk's end (warm chunks, supervised mode) saves that step through save_freq only."""
    freq = spec.settings.save_freq or spec.chunk_steps
    if spec.chunk_steps < spec.total_steps and spec.chunk_steps % freq:
        return f"save_freq {freq} does not divide chunk_steps {spec.chunk_steps}"
    return None


def warm_blocker(spec) -> str | None:
    """Why a verl_ppo spec's chunks cannot hand over warm (None: they can): supervised mode is one job already, and
    verl's loop saves a warm chunk's end through save_freq only (it does not end there)."""
    if spec.settings.mode == "supervised":
        return "supervised mode runs the whole run as one job already: there is no chunk to hand off"
    if why := unsaved_chunk_end(spec):
        return (
            f"{why}: with warm chunks every chunk's end step must be saved by verl's save_freq (its loop does not end there)"
        )
    return None
