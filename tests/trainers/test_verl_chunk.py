"""verl's main_ppo as chunks, on CPU, through verl 0.9.1's real trainer classes.

The job's driver (relay.trainers.verl_ppo.trainer.train_chunk) runs for real: lease, hygiene,
resume validation, Hydra composition of verl's own ppo_trainer.yaml, verl's validate_config. The
TaskRunner actor is replaced by the same steps in this process (detach the chunk, install the
trainer into verl's registry, look it up the way TaskRunnerV1 does, init, fit). verl's own
PPOTrainer.__init__, _init_dataloader, _load_checkpoint, _save_checkpoint and fit() loop run; only
what needs GPUs is stood in for: the worker groups (a fake that keeps a real optimizer with the LR
scheduler built by verl's own FSDPEngine._build_lr_scheduler from the config the trainer hands its
workers, and saves it in verl's layout), the rollout step, validation and metric computation, and
TransferQueue's kv_clear.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from relay.common.errors import CheckpointError, SpecError
from relay.runs import layout
from relay.runs.run import Run
from relay.spec.run_spec import spec_from_dict
from relay.trainers.contract import ChunkRequest

pytestmark = pytest.mark.processes  # verl's trainer classes and engine in this process, seconds a test: not in the fast lane

TOTAL, CHUNK = 30, 10


def make_spec(tmp_path: Path, *, chunk_steps=CHUNK, optim=None, chunks=None, **settings):
    from relay.trainers.tiny_grpo import task

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    if not (data / "train.parquet").exists():
        task.make_dataset(data / "train.parquet", 64, 1)
        task.make_dataset(data / "val.parquet", 8, 2, "test")
    s = {
        "model_path": str(tmp_path / "model"),
        "nnodes": 1,
        "n_gpus_per_node": 1,
        "train_batch_size": 4,
        "ppo_mini_batch_size": 2,
        "ppo_micro_batch_size_per_gpu": 2,
        "log_prob_micro_batch_size_per_gpu": 2,
        "tensor_model_parallel_size": 1,
        "total_epochs": 2,
        "rollout_n": 2,
        "optim": optim or {"lr": 1e-3, "lr_scheduler_type": "cosine", "lr_warmup_steps_ratio": 0.1, "min_lr_ratio": 0.1},
        "overrides": ["data.dataloader_num_workers=0"],
        **settings,
    }
    d = {
        "name": "gsm",
        "trainer": {"kind": "verl_ppo", "settings": s},
        "total_steps": TOTAL,
        "chunk_steps": chunk_steps,
        "seed": 7,
        "threads": 1,
        "checkpoint_dir": str(tmp_path / "ckpt"),
        # (the stand-in worker group writes no model verl's huggingface/ config could build)
        "checkpoints": {"smoke": False},
        "data": {"train_files": [str(data / "train.parquet")], "val_files": [str(data / "val.parquet")]},
    }
    d["chunks"] = chunks or {"handoff": "cold"}  # (warm chunks wait for each chunk's admission: a test's own)
    return spec_from_dict(d, check_environment=False)


# ------------------------------------------------------------------------- stand-ins for the GPUs
class FakeWorkerGroup:
    """The actor worker group: a real optimizer and verl's own LR scheduler, built from the optimizer
    config the trainer hands its workers (after _init_dataloader, as PPOTrainer._setup does)."""

    def __init__(self, optim_conf, log: dict):
        import torch
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

        self.param = torch.nn.Parameter(torch.zeros(4))
        self.opt = torch.optim.AdamW([self.param], lr=float(optim_conf.lr))
        cfg = omega_conf_to_dataclass(optim_conf)
        self.horizon = cfg.total_training_steps
        self.sched = FSDPEngine._build_lr_scheduler(types.SimpleNamespace(optimizer_config=cfg, rank=1), self.opt)
        self.log = log

    def train_step(self, step: int) -> float:
        lr = self.sched.get_last_lr()[0]
        self.param.grad = self.param.detach() + 1.0
        self.opt.step()
        self.sched.step()
        self.log["lr"][step] = lr
        return lr

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        import torch

        p = Path(local_path)
        (p / "huggingface").mkdir(parents=True, exist_ok=True)
        torch.save({"w": self.param.detach().clone()}, p / layout.shard_name("model", 1, 0))
        torch.save(self.opt.state_dict(), p / layout.shard_name("optim", 1, 0))
        torch.save(
            {"lr_scheduler": self.sched.state_dict(), "rng": {"cpu": torch.get_rng_state()}},
            p / layout.shard_name("extra_state", 1, 0),
        )
        (p / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
        (p / "huggingface" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
        self.log["saved"].append(global_step)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        import torch

        p = Path(local_path)
        self.param.data.copy_(torch.load(p / layout.shard_name("model", 1, 0), weights_only=True)["w"])
        self.opt.load_state_dict(torch.load(p / layout.shard_name("optim", 1, 0), weights_only=True))
        self.sched.load_state_dict(torch.load(p / layout.shard_name("extra_state", 1, 0), weights_only=True)["lr_scheduler"])


@pytest.fixture
def gpu_stand_ins(monkeypatch):
    """Stand in for what needs GPUs in verl's PPOTrainer; record what verl's loop did."""
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from relay.trainers.tiny_grpo import task
    from relay.trainers.verl_ppo import horizon

    assert horizon.loop_bound_problems() == []  # read from verl's real source, before anything is stood in for
    log = {"lr": {}, "batches": {}, "validated": [], "saved": [], "steps": [], "horizon": [], "trainer_cls": []}

    def _setup(self):  # PPOTrainer._setup, minus Ray worker groups and rollout servers
        tok = task.hf_tokenizer()
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        self.tokenizer, self.processor = tok, None
        self._init_dataloader()
        self._init_dump_executor()
        self.actor_rollout_wg = FakeWorkerGroup(self.config.actor_rollout_ref.actor.optim, log)
        log["horizon"].append(self.actor_rollout_wg.horizon)
        self.checkpoint_manager = types.SimpleNamespace(
            update_weights=lambda *a, **k: None, sleep_replicas=lambda *a, **k: None
        )
        self._load_checkpoint()

    def step(self, metrics, timing_raw):  # rollout + update: one optimizer step, one scheduler step
        batch = self._fetch_one_gen_batch()
        log["batches"][self.global_steps] = [int(i) for i in batch["index"]]
        log["steps"].append(self.global_steps)
        self._lr = self.actor_rollout_wg.train_step(self.global_steps)
        return types.SimpleNamespace(keys=[], partition_id="train")

    def _validate(self):
        log["validated"].append(self.global_steps)
        return {"val-core/score": 1.0}

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        metrics.update({"actor/lr": self._lr, "critic/score/mean": 0.5, "actor/pg_loss": 0.1})

    monkeypatch.setattr(PPOTrainer, "_setup", _setup)
    monkeypatch.setattr(PPOTrainer, "step", step)
    monkeypatch.setattr(PPOTrainer, "_validate", _validate)
    monkeypatch.setattr(PPOTrainer, "_compute_metrics", _compute_metrics)
    monkeypatch.setattr(trainer_base.tq, "kv_clear", lambda **kw: None)

    def in_process_task_runner(config, graceful=None):
        """RelayTaskRunner.run's steps, then TaskRunnerV1.run's trainer lookup, init and fit, in this process."""
        from omegaconf import OmegaConf
        from verl.trainer.ppo.v1 import get_trainer_cls

        from relay.trainers.verl_ppo import chunk_trainer, verl_chunk

        chunk = verl_chunk.detach(config)
        chunk_trainer.install(chunk)
        OmegaConf.resolve(config)
        cls = get_trainer_cls(config.trainer.v1.trainer_mode)
        log["trainer_cls"].append(cls.__qualname__)
        trainer = cls(config=config)
        trainer.init()
        trainer.fit(None)

    from relay.trainers.verl_ppo import trainer as verl_trainer

    monkeypatch.setattr(verl_trainer, "run_verl", in_process_task_runner)
    yield log
    # the registry is process-global: give verl's own class back
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer_base.TRAINER_REGISTRY["sync"] = PPOTrainerSync


def run_chunks(spec, run: str, ends: list[int]) -> list:
    """Each chunk as a DAG's job (a warm spec's job goes on into the next chunk, as the DAG's does)."""
    from relay.trainers.verl_ppo.trainer import train_chunk

    return [
        train_chunk(ChunkRequest(run=Run.of(spec, run), to_step=end, chunk=i + 1, attempt=f"{run}-c{i + 1}", handoff=True))
        for i, end in enumerate(ends)
    ]


def verl_lrs(spec, horizon: int, steps: int) -> list[float]:
    """LR at each step from verl's own scheduler builder with this spec's optimizer settings."""
    from relay.trainers.verl_ppo import overrides

    cfg = overrides.compose(
        overrides.chunk_overrides(
            Run.of(spec, "x"),
            first_step_of_run=True,
            data={"train": list(spec.data.train_files), "val": list(spec.data.val_files)},
        )
    )
    cfg.actor_rollout_ref.actor.optim.total_training_steps = horizon
    wg = FakeWorkerGroup(cfg.actor_rollout_ref.actor.optim, {"lr": {}, "saved": []})
    return [wg.train_step(s) for s in range(1, steps + 1)]


# ------------------------------------------------------------------------------------ the tests
def test_three_chunks_equal_one_unchunked_run_lr_and_data_at_every_step(tmp_path, gpu_stand_ins, capsys):
    log = gpu_stand_ins
    chunked = make_spec(tmp_path)
    results = run_chunks(chunked, "chunked", [10, 20, 30])
    chunked_lr, chunked_batches = dict(log["lr"]), dict(log["batches"])
    assert [r.resumed_from for r in results] == [0, 10, 20] and [r.end_step for r in results] == [10, 20, 30]
    assert log["steps"] == list(range(1, 31))
    assert log["trainer_cls"] == ["RelayChunkTrainer"] * 3  # verl's lookup found Relay's subclass each time
    # The horizon every chunk's workers got is the run's total, never the chunk's end.
    assert log["horizon"] == [TOTAL] * 3
    # verl saved at every chunk's end (its last step), committed by Relay: tracker and folders agree.
    assert log["saved"] == [10, 20, 30] and layout.read_tracker(chunked.run_dir("chunked")) == 30
    assert sorted(layout.step_dirs(chunked.run_dir("chunked"))) == [10, 20, 30]
    # Validation: before training in chunk 1 only, and at the run's real end; not at the chunk ends 10, 20.
    assert log["validated"] == [0, 30]
    out = capsys.readouterr().out
    assert "[relay] step 10/30 chunk 1" in out and "[relay] step 30/30 chunk 3" in out
    assert "validation skipped" in out

    for k in ("lr", "batches", "saved", "validated", "steps"):
        log[k].clear()
    unchunked = make_spec(tmp_path, chunk_steps=TOTAL)
    run_chunks(unchunked, "straight", [30])
    assert log["validated"] == [0, 30]

    # The LR at every step of the 3-chunk run is the unchunked run's, and verl's own schedule over 30 steps.
    expected = verl_lrs(chunked, TOTAL, TOTAL)
    assert [chunked_lr[s] for s in range(1, 31)] == [log["lr"][s] for s in range(1, 31)] == expected
    assert chunked_batches == log["batches"]  # and the same prompts, in the same order
    # Cosine with a 10% warmup: the schedule rises for 3 steps, then decays to min_lr_ratio's floor.
    assert expected[0] == 0.0 and max(expected) == pytest.approx(1e-3) and expected[-1] < expected[3]

    # The obvious trick (total_training_steps = the chunk's end) would not have been the same run.
    naive = verl_lrs(chunked, 10, 10)  # chunk 1's horizon would have been 10 steps
    assert naive != expected[:10]

    rows = [json.loads(x) for x in (chunked.run_dir("chunked") / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 31)) and rows[0]["reward_mean"] == 0.5
    assert [r["chunk"] for r in rows] == [1] * 10 + [2] * 10 + [3] * 10


def test_warm_chunks_run_in_one_trainer_and_are_the_unchunked_run(tmp_path, gpu_stand_ins, capsys):
    """chunks.handoff warm: chunk 1's job goes on into chunks 2 and 3 in the same verl trainer (its loop bound moved
    to each next chunk's end once the chunk's end is committed), each admitted as its train task does; the LR and
    the prompts at every step are the unchunked run's."""
    import threading
    import time

    from relay.runs import handoff
    from relay.runs.metrics import read_events

    log = gpu_stand_ins
    warm = make_spec(tmp_path, chunks={"handoff": "warm"})
    run_dir = warm.run_dir("warm")
    done = threading.Event()

    def admit():  # what chunk k's train task does once its checks pass
        admitted: set[int] = set()
        while not done.is_set():
            for k in (2, 3):
                if k not in admitted and (record := handoff.warm(run_dir, k)) is not None:
                    handoff.admit(run_dir, k, attempt=record["attempt"], token=record["token"], by="the test's task")
                    admitted.add(k)
            time.sleep(0.01)

    task = threading.Thread(target=admit, daemon=True)
    task.start()
    try:
        [result] = run_chunks(warm, "warm", [10])
    finally:
        done.set()
        task.join()
    assert (result.resumed_from, result.end_step) == (0, 30)
    assert log["trainer_cls"] == ["RelayChunkTrainer"], "one trainer for the three chunks: one start-up"
    assert log["saved"] == [10, 20, 30] and layout.read_tracker(run_dir) == 30
    assert log["validated"] == [0, 30], "not at the chunk ends"
    events = read_events(run_dir)
    starts = [(e["chunk"], e["resumed_from"], e["warm"]) for e in events if e["event"] == "chunk_start"]
    assert starts == [(1, 0, False), (2, 10, True), (3, 20, True)]
    ends = [(e["chunk"], e["end_step"], e.get("handoff")) for e in events if e["event"] == "chunk_end"]
    assert ends == [(1, 10, "warm"), (2, 20, "warm"), (3, 30, None)]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["chunk"] for r in rows] == [1] * 10 + [2] * 10 + [3] * 10
    assert "[relay] step 30/30 chunk 3" in capsys.readouterr().out
    warm_lr, warm_batches = dict(log["lr"]), dict(log["batches"])

    for k in ("lr", "batches", "saved", "validated", "steps"):
        log[k].clear()
    run_chunks(make_spec(tmp_path, chunk_steps=TOTAL), "straight", [30])
    assert [warm_lr[s] for s in range(1, 31)] == [log["lr"][s] for s in range(1, 31)]
    assert warm_batches == log["batches"]


def test_a_killed_chunk_resumes_from_the_latest_checkpoint_and_matches(tmp_path, gpu_stand_ins):
    """A chunk whose job died after step 15's checkpoint (save_freq 5) resumes there, not at 10."""
    log = gpu_stand_ins
    spec = make_spec(tmp_path, save_freq=5)
    run_chunks(spec, "r", [10, 15])  # "chunk 2" died: its attempt got to 15 (saved), never to 20
    from relay.trainers.verl_ppo.trainer import train_chunk

    r = train_chunk(ChunkRequest(run=Run.of(spec, "r"), to_step=20, chunk=2, attempt="r-c2-t2"))
    assert r.resumed_from == 15 and layout.read_tracker(spec.run_dir("r")) == 20
    assert log["saved"] == [5, 10, 15, 20]
    assert [log["lr"][s] for s in range(1, 21)] == verl_lrs(spec, TOTAL, 20)


def test_relay_train_of_a_warm_spec_to_a_step_inside_a_chunk_saves_that_step(tmp_path, gpu_stand_ins):
    """`relay train --to-step 15` of a spec whose chunks go on warm (a DAG's jobs do; relay train's never): verl's
    loop ends at step 15 and saves it, although 15 is no chunk's end and save_freq does not fall on it."""
    log = gpu_stand_ins
    spec = make_spec(tmp_path, chunks={"handoff": "warm"})
    from relay.trainers.verl_ppo.trainer import train_chunk

    r = train_chunk(ChunkRequest(run=Run.of(spec, "w"), to_step=15, chunk=2, attempt="w-c2-t1"))
    assert r.end_step == 15 and layout.read_tracker(spec.run_dir("w")) == 15
    assert log["saved"] == [10, 15] and max(log["steps"]) == 15


def test_a_stop_asked_after_a_step_saves_it_through_verls_save_and_the_next_chunk_resumes_there(
    tmp_path, gpu_stand_ins, monkeypatch
):
    """save_before closer than another step and a save: after step 11 RelayChunkTrainer.on_step_end saves step 11
    through verl's own _save_checkpoint (no save_freq falls on it), ends verl's loop, and the chunk ends with
    StoppedEarly; the next chunk resumes from 11 and the run has verl's LR and data at every step. A deadline
    already too close when verl's loop begins stops it before its first step."""
    import time

    from relay.common.errors import StoppedEarly
    from relay.runs.metrics import read_events
    from relay.trainers import stopping
    from relay.trainers.verl_ppo.trainer import train_chunk

    log = gpu_stand_ins
    spec = make_spec(tmp_path)
    run_chunks(spec, "s", [10])
    soon = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 600))
    late = spec.model_copy(update={"save_before": soon})
    # The stand-in steps take milliseconds: once a step of this chunk ran, another is taken to need an hour.
    monkeypatch.setattr(stopping, "time_needed", lambda steps, save: 3600.0 if steps else 0.0)
    with pytest.raises(StoppedEarly) as stopped:
        train_chunk(ChunkRequest(run=Run.of(late, "s"), to_step=20, chunk=2, attempt="s-c2-t1"))
    assert stopped.value.exit_code == 4 and stopped.value.cause == "preempted"
    assert "stopped after step 11 (save_before " in str(stopped.value), str(stopped.value)
    run_dir = spec.run_dir("s")
    assert log["saved"] == [10, 11] and layout.read_tracker(run_dir) == 11
    stops = [e for e in read_events(run_dir) if e["event"] == "chunk_stopped"]
    assert [(e["step"], e["attempt"]) for e in stops] == [(11, "s-c2-t1")]

    monkeypatch.setattr(stopping, "time_needed", lambda steps, save: 3600.0)  # too close even for one
    with pytest.raises(StoppedEarly) as early:
        train_chunk(ChunkRequest(run=Run.of(late, "s"), to_step=20, chunk=2, attempt="s-c2-t2"))
    assert "stopped before training a step (save_before " in str(early.value) and log["saved"] == [10, 11]

    r = train_chunk(ChunkRequest(run=Run.of(spec, "s"), to_step=20, chunk=2, attempt="s-c2-t3"))
    assert r.resumed_from == 11 and layout.read_tracker(run_dir) == 20
    assert log["steps"] == list(range(1, 21)), "every step once: the stops lost none"
    assert [log["lr"][s] for s in range(1, 21)] == verl_lrs(spec, TOTAL, 20)


def test_validation_at_every_chunk_end_when_the_spec_asks(tmp_path, gpu_stand_ins):
    log = gpu_stand_ins
    spec = make_spec(tmp_path, validate_every_chunk=True, test_freq=4)
    run_chunks(spec, "v", [10, 20])
    assert log["validated"] == [0, 4, 8, 10, 12, 16, 20]


def test_rollout_state_is_moved_out_and_a_world_size_change_is_refused(tmp_path, gpu_stand_ins):
    spec = make_spec(tmp_path)
    run_chunks(spec, "h", [10])
    run_dir = spec.run_dir("h")
    tq_state = run_dir / "global_step_10" / "transfer_queue"
    tq_state.mkdir()
    (tq_state / "inflight.bin").write_bytes(b"x")
    bigger = make_spec(tmp_path, n_gpus_per_node=2)
    with pytest.raises(SpecError, match=r"world size 2 .*step 10's shards are world size 1"):
        run_chunks(bigger, "h", [20])
    assert not tq_state.exists()
    assert list(layout.relay_dir(run_dir, "rollout_state").glob("global_step_10.*/transfer_queue/inflight.bin"))
    fsdp1 = make_spec(tmp_path, fsdp_version=1)
    with pytest.raises(SpecError, match="FSDP1; step 10's shards are world size 1, FSDP2"):
        run_chunks(fsdp1, "h", [20])
    # With checkpoints.on_world_size_change: reshard, a step at the old size is one the chunk's reshard did not see
    # (the resume fell back to it): the error says how to reshard it.
    resharding = spec_from_dict(
        {
            **bigger.model_dump(mode="json", exclude_none=True),
            "checkpoints": {"smoke": False, "on_world_size_change": "reshard"},
        },
        check_environment=False,
    )
    with pytest.raises(SpecError, match=r"reshard step 10 first: `relay checkpoint reshard \S+ --world-size 2 --step 10`"):
        run_chunks(resharding, "h", [20])


def test_verl_and_relay_must_agree_on_the_resume_step(tmp_path, gpu_stand_ins, monkeypatch):
    from relay.trainers.verl_ppo import hygiene

    spec = make_spec(tmp_path)
    run_chunks(spec, "a", [10])
    run_dir = spec.run_dir("a")
    hygiene.check_tracker_agrees(run_dir, 10)
    with pytest.raises(CheckpointError, match=r"verl would resume from .*global_step_10, but Relay validated no "):
        hygiene.check_tracker_agrees(run_dir, 0)
    layout.write_tracker(run_dir, 7)  # a tracker naming a missing folder: verl would silently start at 0
    with pytest.raises(
        CheckpointError,
        match=r"verl would resume from scratch \(step 0\), but Relay validated "
        r".*global_step_10",
    ):
        hygiene.check_tracker_agrees(run_dir, 10)


def test_registration_lives_in_verls_registry_and_verl_refuses_a_second_class():
    from verl.trainer.ppo.v1 import get_trainer_cls, register_trainer, trainer_base
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from relay.trainers.verl_ppo import chunk_trainer, verl_chunk
    from relay.trainers.verl_ppo.async_trainer import AsyncPrompts

    cls = chunk_trainer.RelayChunkTrainer
    assert cls.__mro__[1:3] == (chunk_trainer.RelayChunk, PPOTrainerSync)  # verl's hooks under Relay's, nothing between
    async_cls = chunk_trainer.RelayColocateAsyncTrainer
    assert async_cls.__mro__[1:4] == (AsyncPrompts, chunk_trainer.RelayChunk, PPOTrainerColocateAsync)
    with pytest.raises(ValueError, match="already registered"):  # why install() swaps the entry itself
        register_trainer("sync")(cls)
    try:
        assert chunk_trainer.install(verl_chunk.VerlChunk("{}", 0, 10, 30, "loop_bound")) is cls
        assert get_trainer_cls("sync") is cls
        assert chunk_trainer.install(verl_chunk.VerlChunk("{}", 0, 10, 30, "loop_bound")) is cls  # idempotent
        as_async = verl_chunk.VerlChunk("{}", 0, 10, 30, "loop_bound", trainer_mode="colocate_async")
        assert chunk_trainer.install(as_async) is async_cls and get_trainer_cls("colocate_async") is async_cls
        trainer_base.TRAINER_REGISTRY["sync"] = type("Other", (PPOTrainerSync,), {})
        from relay.trainers.verl_ppo.verl_contract import VerlContractError

        with pytest.raises(VerlContractError, match="another plugin replaced it"):
            chunk_trainer.install(verl_chunk.VerlChunk("{}", 0, 10, 30, "loop_bound"))
        with pytest.raises(VerlContractError, match="no chunk trainer for verl's trainer_mode 'fully_async'"):
            chunk_trainer.install(verl_chunk.VerlChunk("{}", 0, 10, 30, "loop_bound", trainer_mode="fully_async"))
        as_separate = verl_chunk.VerlChunk("{}", 0, 10, 30, "loop_bound", trainer_mode="separate_async")
        separate_cls = chunk_trainer.RelaySeparateAsyncTrainer
        assert separate_cls.__mro__[1:4] == (AsyncPrompts, chunk_trainer.RelayChunk, PPOTrainerSeparateAsync)
        assert chunk_trainer.install(as_separate) is separate_cls and get_trainer_cls("separate_async") is separate_cls
    finally:
        trainer_base.TRAINER_REGISTRY["sync"] = PPOTrainerSync
        trainer_base.TRAINER_REGISTRY["colocate_async"] = PPOTrainerColocateAsync
        trainer_base.TRAINER_REGISTRY["separate_async"] = PPOTrainerSeparateAsync


def test_the_task_runner_is_verls_with_the_install_inside_its_run():
    """The lookup happens in TaskRunnerV1.run (a Ray actor): Relay's runner installs there, not in the driver."""
    import inspect

    import ray
    from verl.trainer import main_ppo

    from relay.trainers.verl_ppo import runner, verl_contract

    registry = ["TRAINER_REGISTRY", "TaskRunnerV1"]
    assert verl_contract.problems(names=registry) == []
    base = runner.original_class(main_ppo.TaskRunnerV1)
    assert "get_trainer_cls(config.trainer.v1.trainer_mode)" in inspect.getsource(base.run)
    assert "task_runner_class" in inspect.signature(main_ppo.run_ppo).parameters
    cls = runner.relay_task_runner()
    assert issubclass(cls, base) and "chunk_trainer.install(chunk)" in inspect.getsource(cls.run)
    actor = runner.task_runner_class()
    assert isinstance(actor, ray.actor.ActorClass)
    assert runner.original_class(actor) is cls
    # Ray ships the class to the actor's process by value (cloudpickle): it must round-trip.
    import cloudpickle

    again = cloudpickle.loads(cloudpickle.dumps(cls))
    assert again.run.__qualname__.endswith("RelayTaskRunner.run")
    assert verl_contract.problems(names=registry) == []  # still answered after Ray-style pickling in this process


def test_contract_holds_for_the_installed_verl():
    from importlib.metadata import version

    from relay.trainers.verl_ppo import horizon, verl_contract

    assert version("verl") == "0.9.1"
    assert verl_contract.problems() == [] and horizon.loop_bound_problems() == []


def test_a_horizon_dependent_schedule_is_refused_when_the_contract_breaks(tmp_path):
    from relay.trainers.verl_ppo import horizon

    broken = ["PPOTrainer.fit no longer has `self.global_steps <= self.total_training_steps`"]
    cosine = make_spec(tmp_path)
    with pytest.raises(horizon.HorizonError, match="refused") as e:
        horizon.chunk_strategy(cosine, broken)
    assert "cosine (warmup 3 steps, horizon 30 steps)" in str(e.value) and "mode: supervised" in str(e.value)
    ratio = make_spec(tmp_path, optim={"lr_scheduler_type": "constant", "lr_warmup_steps_ratio": 0.1})
    with pytest.raises(horizon.HorizonError):
        horizon.chunk_strategy(ratio, broken)
    constant = make_spec(tmp_path, optim={"lr_scheduler_type": "constant", "lr_warmup_steps": 3})
    assert horizon.chunk_strategy(constant, broken) == horizon.TOTAL_STEPS
    assert horizon.chunk_strategy(make_spec(tmp_path, mode="supervised"), broken) == horizon.TOTAL_STEPS
    assert horizon.chunk_strategy(cosine, []) == horizon.LOOP_BOUND


def test_the_total_steps_fallback_is_exact_for_a_horizon_independent_schedule(tmp_path, gpu_stand_ins, monkeypatch):
    """With verl's loop-bound contract broken, a constant schedule with absolute warmup still chunks
    exactly: each chunk ends through verl's own total_training_steps."""
    from relay.trainers.verl_ppo import horizon

    log = gpu_stand_ins
    monkeypatch.setattr(horizon, "loop_bound_problems", lambda: ["pretend verl changed"])
    spec = make_spec(tmp_path, optim={"lr": 1e-3, "lr_scheduler_type": "constant", "lr_warmup_steps": 4})
    run_chunks(spec, "c", [10, 20, 30])
    assert log["horizon"] == [10, 20, 30]
    assert [log["lr"][s] for s in range(1, 31)] == verl_lrs(spec, TOTAL, TOTAL)
    assert log["validated"] == [0, 30]


# ------------------------------------------------------------------------------ supervised mode
def test_supervised_mode_one_job_saves_every_chunk_and_the_chunk_tasks_validate_behind_it(tmp_path, gpu_stand_ins):
    """One job to the run's end (verl's loop untouched), saving every chunk_steps; each chunk's
    validation admits its step while the tracker is already further on."""
    from relay.airflow.supervised import SupervisedValidateOperator
    from relay.preflight.admission import admit
    from relay.spec.plan import ChunkPlan
    from relay.trainers.verl_ppo.overrides import whole_run_view

    log = gpu_stand_ins
    spec = make_spec(tmp_path, mode="supervised")
    view = whole_run_view(spec)
    assert ChunkPlan.from_spec(view).chunk(1).end_step == TOTAL and view.settings.save_freq == CHUNK
    assert view.ray.chunk_timeout_minutes == spec.ray.chunk_timeout_minutes * 3
    assert view.resume_critical() == spec.resume_critical()  # the guard sees the same run
    from relay.trainers.verl_ppo.trainer import train_chunk

    r = train_chunk(ChunkRequest(run=Run.of(view, "s"), to_step=TOTAL, chunk=1, attempt="s-c01-t1"))
    assert r.resumed_from == 0 and r.end_step == TOTAL
    assert log["saved"] == [10, 20, 30] and log["horizon"] == [TOTAL] and log["validated"] == [0, 30]
    assert [log["lr"][s] for s in range(1, 31)] == verl_lrs(spec, TOTAL, TOTAL)
    op = SupervisedValidateOperator(task_id="validate", spec_path="unused", chunk_index=1, train_task=None)
    chunk1 = ChunkPlan.from_spec(spec).chunk(1)
    context = {"ti": types.SimpleNamespace(task_id="chunk_01.validate"), "dag_run": types.SimpleNamespace(run_id="r")}
    admitted = op._validate(context, Run.of(spec, "s"), chunk1)  # tracker at 30, step 10 checked on its own
    assert admitted["ok"] and admitted["step"] == 10
    # The chunked gate would have refused it: it asks the tracker to name the chunk's end.
    strict = admit(Run.of(spec, "s"), 20, expected_step=20)
    assert not strict.ok and "the tracker names step 30" in strict.report.failed.detail


def test_a_failed_supervised_job_is_resubmitted_and_resumes(tmp_path, gpu_stand_ins):
    from relay.trainers.verl_ppo.overrides import whole_run_view
    from relay.trainers.verl_ppo.trainer import train_chunk

    log = gpu_stand_ins
    spec = make_spec(tmp_path, mode="supervised")
    view = whole_run_view(spec)
    # The first try died after step 20's checkpoint (as if its job was stopped there).
    partial = view.model_copy(update={"total_steps": TOTAL})
    train_chunk(ChunkRequest(run=Run.of(partial, "s"), to_step=20, chunk=1, attempt="s-c01-t1"))
    r = train_chunk(ChunkRequest(run=Run.of(view, "s"), to_step=TOTAL, chunk=1, attempt="s-c01-t2"))
    assert r.resumed_from == 20 and log["saved"] == [10, 20, 30]
    assert [log["lr"][s] for s in range(1, 31)] == verl_lrs(spec, TOTAL, TOTAL)


def test_warm_chunks_validate_at_each_chunks_end_when_the_spec_asks(tmp_path):
    """A warm chunk's end is not verl's last step, so verl validates there only through test_freq."""
    from relay.trainers.verl_ppo import overrides

    warm = {"handoff": "warm"}
    assert overrides.test_freq(make_spec(tmp_path, chunks=warm, validate_every_chunk=True)) == CHUNK
    assert overrides.test_freq(make_spec(tmp_path, chunks=warm)) == TOTAL + 1, "the run's end alone"
    assert overrides.test_freq(make_spec(tmp_path, validate_every_chunk=True)) == TOTAL + 1, "cold: verl's last step"


def test_chunks_are_warm_by_default_where_the_run_can_be_and_asking_for_warm_elsewhere_is_refused(tmp_path):
    empty = {"handoff": None}
    assert make_spec(tmp_path, chunks=empty).warm_chunks, "chunked, save_freq 0: warm"
    assert not make_spec(tmp_path, chunks={"handoff": "cold"}).warm_chunks
    assert not make_spec(tmp_path, chunks=empty, mode="supervised").warm_chunks, "one job already"
    assert not make_spec(tmp_path, chunks=empty, save_freq=3).warm_chunks, "3 does not divide chunk_steps 10"
    assert make_spec(tmp_path, chunks=empty, save_freq=5).warm_chunks
    for settings, said in (({"mode": "supervised"}, "supervised mode"), ({"save_freq": 3}, "does not divide")):
        with pytest.raises(SpecError) as e:
            make_spec(tmp_path, chunks={"handoff": "warm"}, **settings)
        assert e.value.key == "chunks.handoff" and said in str(e.value), str(e.value)
