"""verl's Hydra overrides, built from the run spec and the chunk; never written by hand.

`chunk_overrides()` gives the key=value list; `compose()` composes verl's own ppo_trainer.yaml (the
one inside the installed verl package) with it through Hydra's compose API, as main_ppo's
@hydra.main would, but without Hydra changing the working directory. Every key Relay sets exists
in verl's config (Hydra refuses an unknown key without '+'); the one addition is
ray_kwargs.ray_init.address, under a node verl's schema has.

What Relay sets, and why:
- trainer.default_local_dir: the run's folder, absolute (on shared storage): verl's default is
  relative to the working directory and built from project and experiment names.
- trainer.checkpoint_callback_class: Relay's (chunk_trainer.RelaySaved), verl's public hook after each save: it
  names the step folder verl wrote, which Relay certifies and commits.
- trainer.resume_mode=auto: verl resumes from the tracker, which Relay has just validated.
- trainer.save_freq: > 0 always (verl saves on its last step only then); chunk_steps in supervised mode.
- trainer.total_training_steps: the run's total, the LR schedule's horizon (see horizon.py).
- trainer.val_before_train: only in chunk 1, from step 0.
- trainer.project_name / experiment_name: fixed per run (tracking; they also name verl's default dir).
- trainer.max_*_ckpt_to_keep=null: verl's rotation forgets earlier processes' checkpoints; Relay's
  retention keeps what is validated and published.
- data.train_files / val_files: the run's frozen copies, never the source paths.
- ray_kwargs.ray_init.address: the cluster the job runs on, never a new local Ray.
- rollout.agent.default_agent_loop: with the hf rollout, its agent loop (cpu/hf_rollout.RelaySingleTurnAgentLoop).
- trainer.v1.*: the spec's trainer_mode; for the async modes their warm-up batches and Relay's sampler, for
  separate_async the rollout's own GPUs and checkpoint engine too (async_overrides).
- trainer.device: the spec's device (cpu: Relay's cpu platform, see cpu/platform.py).
- the models' attn_implementation (override_config, an empty mapping in verl's yaml, hence '+'): the
  spec's, else sdpa on a CPU (verl's default flash_attention_2 needs flash-attn and a GPU).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from relay.common.errors import SpecError
from relay.runs.run import Run
from relay.spec.plan import ChunkPlan
from relay.trainers.verl_ppo import tracking
from relay.trainers.verl_ppo.horizon import TOTAL_STEPS
from relay.trainers.verl_ppo.settings import unsaved_chunk_end
from relay.trainers.verl_ppo.verl_contract import HF_AGENT_LOOP, HF_ROLLOUT

CHECKPOINT_CALLBACK = "relay.trainers.verl_ppo.chunk_trainer.RelaySaved"  # imports verl: named, not imported, here

# the only '+' overrides: not in verl's yaml, their parent is
ADDED_KEYS = (
    "ray_kwargs.ray_init.address",
    "actor_rollout_ref.model.override_config.attn_implementation",
    "critic.model.override_config.attn_implementation",
)


def verl_config_dir() -> Path:
    """verl's trainer/config folder inside the installed package (found without importing verl)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.origin:
        raise SpecError("trainer", "trainer.kind", "verl is not installed here", "install verl==0.9.1")
    return Path(spec.origin).parent / "trainer" / "config"


def quote(value) -> str:
    """A value in Hydra's override grammar: strings quoted, lists bracketed, None as null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(quote(v) for v in value) + "]"
    s = str(value)
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def save_freq(spec) -> int:
    s = spec.settings
    warm = spec.warm_chunks and s.mode != "supervised"
    # (the job itself sees the whole run as one chunk, its save_freq already checked by the DAG)
    if (s.mode == "supervised" or warm) and (why := unsaved_chunk_end(spec)):
        raise SpecError(
            spec.source,
            "trainer.settings.save_freq",
            f"{why}: {'with warm chunks' if warm else 'in supervised mode'} every chunk's end step must be saved "
            "by verl's save_freq (its loop does not end there)",
            f"use a divisor of {spec.chunk_steps}, or 0",
        )
    return s.save_freq or spec.chunk_steps


def test_freq(spec) -> int:
    """verl's test_freq. verl validates on its last step only when test_freq > 0, so without a spec's own
    test_freq Relay passes total_steps + 1: positive, and a multiple of no step, so the run's end alone
    validates (a chunk's end, verl's last step in its job, is skipped by RelayChunk._validate).
    Supervised mode and warm chunks (whose chunk ends are not verl's last step either) validate at every chunk's
    end through test_freq = chunk_steps when the spec asks."""
    s = spec.settings
    if (s.mode == "supervised" or spec.warm_chunks) and s.validate_every_chunk and s.test_freq <= 0:
        return spec.chunk_steps
    return s.test_freq if s.test_freq > 0 else spec.total_steps + 1


def chunk_overrides(
    run: Run,
    *,
    first_step_of_run: bool,
    data: dict[str, list[str]],
    strategy: str = "loop_bound",
    end_step: int | None = None,
    world=None,
) -> list[str]:
    """verl's overrides for one chunk (chunked mode) or the one job (supervised mode).

    first_step_of_run: the job starts at step 0 (only then does val_before_train apply).
    end_step: the chunk's end; used for total_training_steps only with strategy total_steps.
    world: the settings at the job's world size (an elastic spec's, VerlPPOSettings.at); default the spec's.
    """

    spec = run.spec
    s = spec.settings
    if not data.get("val"):
        raise SpecError(
            spec.source,
            "data.val_files",
            "verl's main_ppo needs validation files",
            "add data.val_files (e.g. GSM8K's test split)",
        )
    run_dir = run.dir
    if not run_dir.is_absolute():
        raise SpecError(
            spec.source,
            "checkpoint_dir",
            f"{run_dir} is not absolute",
            "use an absolute checkpoint_dir on storage that every node mounts",
        )
    total = end_step if strategy == TOTAL_STEPS else spec.total_steps
    o = s.optim
    out = {
        "trainer.default_local_dir": str(run_dir),
        "trainer.checkpoint_callback_class": CHECKPOINT_CALLBACK,
        "trainer.resume_mode": "auto",
        "trainer.save_freq": save_freq(spec),
        "trainer.total_training_steps": total,
        "trainer.total_epochs": s.total_epochs,
        "trainer.val_before_train": bool(s.val_before_train and first_step_of_run),
        "trainer.test_freq": test_freq(spec),
        "trainer.project_name": tracking.project_name(spec),
        "trainer.experiment_name": tracking.experiment_name(run),
        "trainer.logger": list(s.logger),
        "trainer.nnodes": (world or s.at(None)).nnodes,
        "trainer.n_gpus_per_node": (world or s.at(None)).n_gpus_per_node,
        "trainer.max_actor_ckpt_to_keep": None,
        "trainer.max_critic_ckpt_to_keep": None,
        "trainer.del_local_ckpt_after_load": False,
        "trainer.device": s.device,
        "trainer.use_v1": True,
        "trainer.v1.trainer_mode": s.trainer_mode,
        "data.train_files": list(data["train"]),
        "data.val_files": list(data["val"]),
        "data.train_batch_size": s.train_batch_size,
        "data.max_prompt_length": s.max_prompt_length,
        "data.max_response_length": s.max_response_length,
        "data.shuffle": s.shuffle,
        "data.seed": spec.seed,
        "actor_rollout_ref.model.path": s.model_path,
        "actor_rollout_ref.actor.strategy": s.strategy,
        "actor_rollout_ref.actor.ppo_mini_batch_size": s.ppo_mini_batch_size,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": s.ppo_micro_batch_size_per_gpu,
        "actor_rollout_ref.actor.use_kl_loss": s.use_kl_loss,
        "actor_rollout_ref.actor.kl_loss_coef": s.kl_loss_coef,
        "actor_rollout_ref.actor.kl_loss_type": s.kl_loss_type,
        "actor_rollout_ref.actor.entropy_coeff": s.entropy_coeff,
        "actor_rollout_ref.actor.clip_ratio": s.clip_ratio,
        "actor_rollout_ref.actor.data_loader_seed": spec.seed,
        "actor_rollout_ref.actor.checkpoint.async_save": False,
        "actor_rollout_ref.actor.optim.lr": o.lr,
        "actor_rollout_ref.actor.optim.lr_scheduler_type": o.lr_scheduler_type,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": o.lr_warmup_steps,
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": o.lr_warmup_steps_ratio,
        "actor_rollout_ref.actor.optim.min_lr_ratio": o.min_lr_ratio,
        "actor_rollout_ref.actor.optim.num_cycles": o.num_cycles,
        "actor_rollout_ref.actor.optim.weight_decay": o.weight_decay,
        "actor_rollout_ref.actor.optim.clip_grad": o.clip_grad,
        "actor_rollout_ref.rollout.name": s.rollout_name,
        "actor_rollout_ref.rollout.n": s.rollout_n,
        "actor_rollout_ref.rollout.temperature": s.temperature,
        "actor_rollout_ref.rollout.seed": spec.seed,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": s.tensor_model_parallel_size,
        "actor_rollout_ref.rollout.gpu_memory_utilization": s.gpu_memory_utilization,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": s.log_prob_micro_batch_size_per_gpu,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": s.log_prob_micro_batch_size_per_gpu,
        "algorithm.adv_estimator": s.adv_estimator,
        "algorithm.use_kl_in_reward": s.use_kl_in_reward,
    }
    if s.trainer_mode != "sync":
        out.update(async_overrides(s))
    if s.rollout_name == HF_ROLLOUT:
        out["actor_rollout_ref.rollout.agent.default_agent_loop"] = HF_AGENT_LOOP
        # the stand-in engine's timing (cpu/hf_rollout.py reads it from the rollout's engine_kwargs)
        out["+actor_rollout_ref.rollout.engine_kwargs.hf.token_latency_ms"] = s.hf_engine.token_latency_ms
        out["+actor_rollout_ref.rollout.engine_kwargs.hf.response_lengths"] = s.hf_engine.response_lengths
    if s.has_critic:
        out.update(
            {
                "critic.model.path": s.model_path,
                "critic.strategy": s.strategy,
                "critic.checkpoint.async_save": False,
                # the critic's micro-batches as the actor's (verl refuses a critic config without one)
                "critic.ppo_micro_batch_size_per_gpu": s.ppo_micro_batch_size_per_gpu,
            }
        )
    lines = [f"{k}={quote(v)}" for k, v in out.items()]
    lines.append(f"+ray_kwargs.ray_init.address={quote(s.ray_address)}")
    if s.attention:
        models = ["actor_rollout_ref.model"] + (["critic.model"] if s.has_critic else [])
        lines += [f"+{m}.override_config.attn_implementation={quote(s.attention)}" for m in models]
    return lines + [o.strip() for o in s.overrides]


def async_overrides(s) -> dict:
    """The async modes (relay.trainers.verl_ppo.async_trainer): Relay's sampler; bitwise: no staleness bound (each
    prompt is trained `warmup_batches` steps after it was handed out, by design); lossless: verl's bound at
    max_staleness with the spec's stale_strategy. separate_async: its mini-batches per step, the rollout's own GPUs
    and the engine that gives them the weights; verl's hybrid switching (the training GPUs lent to generation while
    they wait) stays off, verl's default."""
    lossless = s.exactness == "lossless"
    out = {
        f"trainer.v1.{s.trainer_mode}.num_warmup_batches": s.warmup_batches,
        # bitwise: no bound (each prompt is trained warmup_batches steps after it was handed out, by the drain);
        # lossless: verl's own bound, its `wait` strategy (none lost) or `drop` (evictions the ledger records)
        "trainer.v1.sampler.max_off_policy_threshold": s.staleness_bound if lossless else None,
        "trainer.v1.sampler.max_off_policy_strategy": s.stale_strategy if lossless else "wait",
        "trainer.v1.sampler.custom_sampler.path": "pkg://relay.trainers.verl_ppo.async_trainer",
        "trainer.v1.sampler.custom_sampler.name": "FirstInFirstOut",
    }
    if s.trainer_mode == "separate_async":
        out.update(
            {
                "trainer.v1.separate_async.parameter_sync_step": s.parameter_sync_step,
                "trainer.v1.separate_async.hybrid_rollout.enable_switch": False,
                "actor_rollout_ref.rollout.nnodes": s.rollout_nnodes,
                "actor_rollout_ref.rollout.n_gpus_per_node": s.rollout_n_gpus_per_node,
                "actor_rollout_ref.rollout.checkpoint_engine.backend": s.engine_for_weights,
            }
        )
    return out


def compose(overrides: list[str]):
    """verl's ppo_trainer.yaml (from the installed package) with the overrides, via Hydra's compose API."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None, job_name="relay_verl_ppo"):
        return hydra_compose(config_name="ppo_trainer", overrides=list(overrides))


def check_config(config) -> None:
    """verl's own config validation, as main_ppo runs it before anything starts."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


def whole_run_view(spec):
    """The spec as the supervising task and its job see it: one chunk of every step; verl saves every
    chunk_steps (or the spec's save_freq, a divisor of it); the timeout covers every chunk."""

    chunks = len(ChunkPlan.from_spec(spec).chunks)
    settings = dict(spec.trainer.settings)
    settings["save_freq"] = save_freq(spec)  # checked against the real chunk_steps here
    if settings.get("validate_every_chunk"):
        settings["test_freq"] = test_freq(spec)
    view = spec.model_copy(
        update={
            "chunk_steps": spec.total_steps,
            "trainer": spec.trainer.model_copy(update={"settings": settings}),
            "ray": spec.ray.model_copy(update={"chunk_timeout_minutes": spec.ray.chunk_timeout_minutes * chunks}),
        }
    )
    view._source = spec.source
    return view
