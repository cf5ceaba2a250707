"""verl's config for a chunk, composed on CPU from verl 0.9.1's own ppo_trainer.yaml with Relay's
overrides (Hydra's compose API), checked by verl's own validate_config; the job's command line and
runtime_env, exactly; the spec's settings and what they refuse."""

from __future__ import annotations

import json

import pytest

from relay.common import files
from relay.common.errors import SpecError
from relay.runs.run import Run
from relay.spec.run_spec import spec_from_dict
from relay.trainers.contract import ENV_VAR, ChunkRequest

MODEL = "/shared/models/Qwen2.5-3B-Instruct"


def spec_of(tmp_path, *, mode="chunked", total=30, chunk=10, **settings):
    s = {
        "mode": mode,
        "model_path": MODEL,
        "optim": {"lr": 1e-6, "lr_scheduler_type": "cosine", "lr_warmup_steps_ratio": 0.1},
        **settings,
    }
    d = {
        "name": "gsm8k",
        "trainer": {"kind": "verl_ppo", "settings": s},
        "total_steps": total,
        "chunk_steps": chunk,
        "seed": 42,
        "threads": 4,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "data": {"train_files": ["/shared/data/gsm8k/train.parquet"], "val_files": ["/shared/data/gsm8k/test.parquet"]},
    }
    return spec_from_dict(d, check_environment=False)


FROZEN = {"train": ["/ckpt/r/data/aaa.parquet"], "val": ["/ckpt/r/data/bbb.parquet"]}


def overrides_for(spec, first=True, **kw):
    from relay.trainers.verl_ppo import overrides

    return overrides.chunk_overrides(Run.of(spec, "r"), first_step_of_run=first, data=FROZEN, **kw)


def as_dict(lines):
    return {k: v for k, _, v in (x.partition("=") for x in lines)}


def test_chunk_overrides_from_the_spec(tmp_path):
    spec = spec_of(tmp_path)
    o = as_dict(overrides_for(spec))
    run_dir = str(tmp_path / "ckpt" / "r")
    assert o["trainer.default_local_dir"] == f"'{run_dir}'"
    assert o["trainer.resume_mode"] == "'auto'"
    assert o["trainer.total_training_steps"] == "30"  # the run's total: the LR horizon, never the chunk's end
    assert o["trainer.save_freq"] == "10"
    assert o["trainer.val_before_train"] == "true"
    assert o["trainer.test_freq"] == "31"  # > 0, so verl validates at its last step; no step is a multiple
    assert o["trainer.project_name"] == "'relay-gsm8k'" and o["trainer.experiment_name"] == "'r'"
    assert o["trainer.max_actor_ckpt_to_keep"] == "null" and o["trainer.v1.trainer_mode"] == "'sync'"
    assert o["data.train_files"] == "['/ckpt/r/data/aaa.parquet']"  # the frozen copy
    assert o["data.val_files"] == "['/ckpt/r/data/bbb.parquet']"
    assert o["actor_rollout_ref.actor.strategy"] == "'fsdp2'" and o["actor_rollout_ref.rollout.name"] == "'vllm'"
    assert o["+ray_kwargs.ray_init.address"] == "'auto'"
    later = as_dict(overrides_for(spec, first=False))
    assert later["trainer.val_before_train"] == "false"  # only chunk 1, from step 0


def test_the_composed_config_passes_verls_own_validation(tmp_path):
    """verl's ppo_trainer.yaml from the installed package + Relay's overrides, via Hydra's compose API."""
    from relay.trainers.verl_ppo import overrides

    spec = spec_of(tmp_path, logger=["console", "wandb"], overrides=["actor_rollout_ref.model.use_remove_padding=true"])
    cfg = overrides.compose(overrides_for(spec))
    assert str(overrides.verl_config_dir()).endswith("site-packages/verl/trainer/config")
    assert cfg.trainer.default_local_dir == str(tmp_path / "ckpt" / "r")
    assert cfg.trainer.total_training_steps == 30 and cfg.trainer.save_freq == 10
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    assert cfg.actor_rollout_ref.actor.optim.lr_warmup_steps_ratio == 0.1
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert list(cfg.data.train_files) == FROZEN["train"] and list(cfg.trainer.logger) == ["console", "wandb"]
    assert cfg.ray_kwargs.ray_init.address == "auto" and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor_rollout_ref.rollout.n == 5 and cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes == 8
    overrides.check_config(cfg)  # verl.utils.config.validate_config, as main_ppo runs it


def test_every_key_relay_sets_exists_in_verls_schema(tmp_path):
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from relay.trainers.verl_ppo import overrides

    base = overrides.compose([])
    spec = spec_of(tmp_path, adv_estimator="gae")  # with the critic's keys too
    keys = [line.partition("=")[0] for line in overrides_for(spec)]
    plain = [k for k in keys if not k.startswith("+")]

    def exists(key: str) -> bool:  # the key is in verl's schema (a mandatory '???' value counts)
        node = base
        for part in key.split("."):
            if not OmegaConf.is_dict(node) or part not in list(node.keys()):
                return False
            node = node._get_node(part)
        return True

    assert [k for k in plain if not exists(k)] == []
    assert "actor_rollout_ref.rollout.name" in plain and OmegaConf.is_missing(base.actor_rollout_ref.rollout, "name")
    added = [k[1:] for k in keys if k.startswith("+")]
    assert "ray_kwargs.ray_init.address" in added and set(added) <= set(overrides.ADDED_KEYS)
    for k in added:  # added under a node verl's schema has, and not already there
        parent, _, leaf = k.rpartition(".")
        assert OmegaConf.select(base, parent) is not None and leaf not in OmegaConf.select(base, parent)
    with pytest.raises(ConfigCompositionException):  # a typo fails: Hydra refuses an unknown key
        overrides.compose([*overrides_for(spec), "trainer.save_frequency=3"])


def test_values_survive_hydra_quoting(tmp_path):
    from relay.trainers.verl_ppo import overrides

    odd = {"train": ["/data/with space/it's.parquet", "/data/b=c,d.parquet"], "val": ["/v/x.parquet"]}
    cfg = overrides.compose(overrides.chunk_overrides(Run.of(spec_of(tmp_path), "r"), first_step_of_run=True, data=odd))
    assert list(cfg.data.train_files) == odd["train"]


def test_supervised_mode_saves_every_chunk_and_runs_to_the_end(tmp_path):
    spec = spec_of(tmp_path, mode="supervised")
    o = as_dict(overrides_for(spec))
    assert o["trainer.save_freq"] == "10" and o["trainer.total_training_steps"] == "30"
    assert as_dict(overrides_for(spec_of(tmp_path, mode="supervised", save_freq=5)))["trainer.save_freq"] == "5"
    every = as_dict(overrides_for(spec_of(tmp_path, mode="supervised", validate_every_chunk=True)))
    assert every["trainer.test_freq"] == "10"
    with pytest.raises(SpecError, match="save_freq 4 does not divide chunk_steps 10"):
        overrides_for(spec_of(tmp_path, mode="supervised", save_freq=4))


def test_colocate_async_composes_with_relays_sampler_and_passes_verls_validation(tmp_path):
    """trainer_mode colocate_async: verl's async trainer, its warm-up batches, Relay's sampler (loaded by verl's
    custom_sampler hook); on GPUs lossless by default, verl's `wait` bound at warmup_batches + 1 policy versions;
    bitwise: no prompt dropped or awaited for staleness; resume-critical."""
    from verl.utils.import_utils import load_extern_type

    from relay.trainers.verl_ppo import overrides

    spec = spec_of(tmp_path, trainer_mode="colocate_async", warmup_batches=2)
    cfg = overrides.compose(overrides_for(spec))
    v1 = cfg.trainer.v1
    assert v1.trainer_mode == "colocate_async" and v1.colocate_async.num_warmup_batches == 2
    assert spec.settings.exactness == "lossless"  # cuda's default
    assert v1.sampler.max_off_policy_threshold == 3 and v1.sampler.max_off_policy_strategy == "wait"
    bitwise = overrides.compose(overrides_for(spec_of(tmp_path, trainer_mode="colocate_async", resume_exactness="bitwise")))
    assert bitwise.trainer.v1.sampler.max_off_policy_threshold is None
    drop = spec_of(tmp_path, trainer_mode="colocate_async", max_staleness=4, stale_strategy="drop")
    dropping = overrides.compose(overrides_for(drop)).trainer.v1.sampler
    assert dropping.max_off_policy_threshold == 4 and dropping.max_off_policy_strategy == "drop"
    sampler = load_extern_type(v1.sampler.custom_sampler.path, v1.sampler.custom_sampler.name)
    assert sampler.__module__ == "relay.trainers.verl_ppo.async_trainer" and sampler.__name__ == "FirstInFirstOut"
    overrides.check_config(cfg)
    crit = spec.resume_critical()
    assert crit["trainer.settings.trainer_mode"] == "colocate_async" and crit["trainer.settings.warmup_batches"] == 2
    assert "trainer.settings.resume_exactness" in crit and "trainer.settings.max_staleness" in crit
    assert as_dict(overrides_for(spec_of(tmp_path)))["trainer.v1.trainer_mode"] == "'sync'"  # the default


def test_separate_async_composes_with_the_rollouts_own_gpus_and_relays_gloo_engine(tmp_path):
    """trainer_mode separate_async: the rollout on GPUs of its own (one logical GPU more for the job), given the
    weights through Relay's gloo engine on a CPU (nccl by default on cuda), parameter_sync_step mini-batches a step,
    verl's hybrid switching off; Relay's sampler as for colocate_async; passes verl's own validation."""
    from relay.trainers.verl_ppo import overrides

    cpu = {"device": "cpu", "rollout_name": "hf", "n_gpus_per_node": 1}
    spec = spec_of(
        tmp_path, trainer_mode="separate_async", train_batch_size=4, ppo_mini_batch_size=2, parameter_sync_step=2, **cpu
    )
    cfg = overrides.compose(overrides_for(spec))
    v1, rollout = cfg.trainer.v1, cfg.actor_rollout_ref.rollout
    assert v1.trainer_mode == "separate_async" and v1.separate_async.num_warmup_batches == 1
    assert v1.separate_async.parameter_sync_step == 2 and v1.separate_async.hybrid_rollout.enable_switch is False
    assert v1.sampler.custom_sampler.name == "FirstInFirstOut" and v1.sampler.max_off_policy_threshold is None
    assert (rollout.nnodes, rollout.n_gpus_per_node, rollout.checkpoint_engine.backend) == (1, 1, "gloo")
    assert spec.settings.exactness == "bitwise"  # cpu's default
    assert dict(rollout.engine_kwargs.hf) == {"token_latency_ms": 0.0, "response_lengths": "model"}
    overrides.check_config(cfg)
    engine = {"token_latency_ms": 40, "response_lengths": "long_tail"}
    timed = spec_of(
        tmp_path,
        trainer_mode="separate_async",
        train_batch_size=4,
        ppo_mini_batch_size=2,
        parameter_sync_step=2,
        resume_exactness="lossless",
        hf_engine=engine,
        **cpu,
    )
    timed_cfg = overrides.compose(overrides_for(timed))
    assert dict(timed_cfg.actor_rollout_ref.rollout.engine_kwargs.hf) == {**engine, "token_latency_ms": 40.0}
    assert timed_cfg.trainer.v1.sampler.max_off_policy_threshold == 2
    overrides.check_config(timed_cfg)
    assert spec.settings.gpus == spec.settings.world_size + 1
    assert spec.resume_critical()["trainer.settings.parameter_sync_step"] == 2
    assert spec_of(tmp_path, trainer_mode="separate_async", ppo_mini_batch_size=1024).settings.engine_for_weights == "nccl"


@pytest.mark.parametrize(
    "settings, why",
    [
        (
            {"trainer_mode": "separate_async", "train_batch_size": 4, "ppo_mini_batch_size": 2},
            r"must equal parameter_sync_step \(1\) x ppo_mini_batch_size \(2\); set parameter_sync_step to 2",
        ),
        ({"trainer_mode": "colocate_async", "parameter_sync_step": 2}, "parameter_sync_step is separate_async's"),
        (
            {
                "trainer_mode": "separate_async",
                "checkpoint_engine": "nccl",
                "ppo_mini_batch_size": 1024,
                "device": "cpu",
                "rollout_name": "hf",
            },
            "checkpoint_engine nccl needs GPUs: on device cpu use gloo",
        ),
        ({"overrides": ["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]}, "Relay sets"),
        ({"resume_exactness": "lossless"}, "resume_exactness lossless is for the async modes"),
        ({"hf_engine": {"token_latency_ms": 20}}, "rollout_name vllm is a real engine: remove hf_engine"),
        (
            {"trainer_mode": "colocate_async", "warmup_batches": 2, "max_staleness": 2},
            r"max_staleness 2 is below warmup_batches \+ 1 \(3\).*set max_staleness to 3 or more",
        ),
        ({"trainer_mode": "colocate_async", "mode": "supervised"}, "runs in mode chunked"),
        ({"trainer_mode": "colocate_async", "warmup_batches": 0}, "warmup_batches"),
        ({"trainer_mode": "colocate_async", "overrides": ["trainer.v1.sampler.max_off_policy_threshold=2"]}, "Relay sets"),
    ],
)
def test_async_settings_relay_cannot_resume_exactly_are_refused(tmp_path, settings, why):
    with pytest.raises(SpecError, match=why):
        spec_of(tmp_path, **settings)


@pytest.mark.parametrize(
    "item, why",
    [
        ("trainer.total_training_steps=10", "Relay sets from the spec"),
        ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.2", "Relay sets from the spec"),
        ("trainer.default_local_dir=/tmp/x", "Relay sets from the spec"),
        ("+trainer.stop_at=10", "no \\+, ~ or \\+\\+"),
        ("~trainer.save_freq", "no \\+, ~ or \\+\\+"),
    ],
)
def test_spec_overrides_may_not_touch_what_relay_owns(tmp_path, item, why):
    with pytest.raises(SpecError, match=why):
        spec_of(tmp_path, overrides=[item])


def test_settings_are_resume_critical_and_world_size_is_derived(tmp_path):
    spec = spec_of(tmp_path, nnodes=2, n_gpus_per_node=8)
    crit = spec.resume_critical()
    for key in (
        "trainer.settings.rollout_n",
        "trainer.settings.adv_estimator",
        "trainer.settings.nnodes",
        "trainer.settings.optim.lr_scheduler_type",
        "trainer.settings.fsdp_version",
        "trainer.settings.model_path",
        "trainer.settings.overrides",
    ):
        assert key in crit
    for key in ("trainer.settings.save_freq", "trainer.settings.mode", "trainer.settings.gpu_memory_utilization"):
        assert key not in crit
    assert spec.settings.world_size == 16 and not spec.settings.has_critic
    from relay.spec.kinds import KINDS

    r = KINDS["verl_ppo"].resolved_settings(spec, 7473)
    assert r["resolved.lr_horizon"] == 30 and r["resolved.lr_schedule"] == "cosine (warmup 3 steps, horizon 30 steps)"
    assert r["resolved.world_size"] == 16 and r["resolved.steps_per_epoch"] == 7


def test_entrypoint_and_runtime_env_exactly(tmp_path, monkeypatch):
    from relay.common import project
    from relay.jobs import ray_jobs
    from relay.preflight.prepare import prepare_run
    from relay.trainers.verl_ppo import tracking

    spec = spec_of(tmp_path)
    prepare_run(spec, "r")
    req = ChunkRequest(run=Run.of(spec, "r"), to_step=20, chunk=2, attempt="relay-gsm8k-r-abc-c02-t1")
    assert ray_jobs.entrypoint(req) == "python -m relay.trainers.job"
    env = ray_jobs.runtime_env(req)
    wandb_id = tracking.wandb_run_id(Run.of(spec, "r"))
    excludes = [*ray_jobs.NOT_SHIPPED, *ray_jobs.NOT_SHIPPED_FILES]
    assert env == {
        "py_modules": [str(project.package_dir())],
        "excludes": excludes,
        "env_vars": {
            "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1",
            "HYDRA_FULL_ERROR": "1",
            "WANDB_RUN_ID": wandb_id,
            "WANDB_RESUME": "allow",
            ENV_VAR: req.to_json(),
            "OMP_NUM_THREADS": "4",
            "MKL_NUM_THREADS": "4",
            "OPENBLAS_NUM_THREADS": "4",
            "PYTHONUNBUFFERED": "1",
            "RAY_JOB_STOP_WAIT_TIME_S": "120",
        },
    }  # ray.stop_grace_seconds: Ray's SIGTERM grace
    # The same id for every chunk of the run (it is derived from the run, not the chunk or the try)...
    req3 = ChunkRequest(run=Run.of(spec, "r"), to_step=30, chunk=3, attempt="relay-gsm8k-r-abc-c03-t2")
    assert ray_jobs.runtime_env(req3)["env_vars"]["WANDB_RUN_ID"] == wandb_id
    # ...and a new one after a fresh start (a new run record).
    import shutil

    shutil.rmtree(spec.run_dir("r"))
    monkeypatch.setattr("time.strftime", lambda *a: "2099-01-01T00:00:00Z")
    prepare_run(spec, "r")
    assert tracking.wandb_run_id(Run.of(spec, "r")) != wandb_id
    # MLflow: the run that chunk 1 started is resumed by every later chunk.
    from relay.runs import layout

    files.atomic_write_json(layout.relay_dir(spec.run_dir("r"), tracking.RECORD), {"mlflow_run_id": "abc123"})
    assert ray_jobs.runtime_env(req3)["env_vars"]["MLFLOW_RUN_ID"] == "abc123"


def test_the_chunk_travels_to_the_task_runner_inside_verls_config(tmp_path):
    from relay.trainers.verl_ppo import overrides, verl_chunk

    cfg = overrides.compose(overrides_for(spec_of(tmp_path)))
    c = verl_chunk.VerlChunk(
        request=json.dumps({"x": "${oc.env:HOME}"}),
        resume_step=10,
        end_step=20,
        total_steps=30,
        strategy="loop_bound",
        tracking_env={"WANDB_RUN_ID": "r-1"},
    )
    verl_chunk.attach(cfg, c)
    from omegaconf import OmegaConf

    OmegaConf.resolve(cfg)  # verl resolves the config in the actor: the payload must not be interpolated
    assert verl_chunk.detach(cfg) == c and verl_chunk.PAYLOAD_KEY not in cfg
    assert c.skip_validation_at(20) and not c.skip_validation_at(30) and not c.skip_validation_at(19)


@pytest.mark.processes
def test_the_dag_file_stays_light_with_a_verl_spec(tmp_path):
    """Loading a verl_ppo spec (as the DAG processor does) imports neither verl, torch, ray nor hydra."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    code = (
        "import sys; sys.path.insert(0, 'plugins'); from relay.spec.run_spec import spec_from_dict; "
        "s = spec_from_dict({'name': 'g', 'trainer': {'kind': 'verl_ppo', 'settings': {'model_path': '/m'}}, "
        "'total_steps': 3, 'chunk_steps': 1, 'seed': 1, 'threads': 1, 'checkpoint_dir': '/tmp/c', "
        "'data': {'train_files': ['/t.parquet'], 'val_files': ['/v.parquet']}}, check_environment=False); "
        "s.settings; s.resume_critical(); "
        "from relay.trainers.verl_ppo import tracking; from relay.airflow import supervised; "
        "print(sorted(m for m in ('verl', 'torch', 'ray', 'hydra', 'omegaconf', 'transformers') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_the_shipped_gsm8k_example_composes_and_passes_verls_validation():
    from pathlib import Path

    from relay.spec.run_spec import load_spec
    from relay.trainers.verl_ppo import overrides

    spec = load_spec(Path(__file__).resolve().parents[2] / "include" / "runs" / "gsm8k_grpo.yaml", check_environment=False)
    s = spec.settings
    assert (s.rollout_n, s.fsdp_version, s.rollout_name, s.n_gpus_per_node, s.adv_estimator) == (5, 2, "vllm", 8, "grpo")
    assert s.steps_available(7473) >= spec.total_steps  # GSM8K's train split, as verl counts
    cfg = overrides.compose(overrides.chunk_overrides(Run.of(spec, "gsm8k_grpo"), first_step_of_run=True, data=FROZEN))
    overrides.check_config(cfg)
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2" and cfg.actor_rollout_ref.model.use_remove_padding
