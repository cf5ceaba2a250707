"""verl's v1 sync trainer, made to stop at a chunk's end step without moving the LR schedule's horizon.

RelayChunkTrainer is a subclass of verl's own PPOTrainerSync. It changes only this:

- `_init_dataloader`: verl computes total_training_steps (the run's total, from the override) and
  writes the optimizer horizon from it; then, and only then, the loop bound `self.total_training_steps`
  is lowered to the chunk's end. The workers, and so their LR schedulers, are built after this
  (PPOTrainer._setup), from the horizon verl wrote. verl's fit() then stops at the chunk's end,
  treating it as its last step: it saves there (save_freq > 0 is always set).
- `_validate`: verl validates on its last step; a chunk's end is not the run's end, so validation
  there is skipped unless the spec asks for it (validate_every_chunk) or test_freq falls on it.
- `_load_checkpoint`: the step verl resumes from must be the one Relay validated just before.
- `_save_checkpoint`: verl's own save, into Relay's staging folder, then the fenced commit (rename
  to global_step_N, tracker written atomically, holding the run's lease), as every Relay trainer does.
- `_balance_batch`: the step's responses are put in one order (dataset index, place in the group) before
  verl balances them, so that the order they were generated in changes no bit of training.
- every step: the run's lease is checked and one row goes to metrics.jsonl.
- `on_step_end` (timed from `on_step_begin`): asked to stop (the driver's stop file, written on its SIGTERM; the
  spec's save_before), the step is saved through verl's own save path and the loop ends after it; at
  `on_train_begin`, a save_before too close for one step ends it before its first (relay.trainers.stopping).
- start-up: a phase mark in events.jsonl at each stage verl passes (relay.runs.phases).
- `_init_resource_pool_mgr`: verl's resource pools are checked against the cluster's nodes before verl
  waits for them without a timeout (relay.trainers.verl_ppo.placement); on the cpu platform each worker
  reserves one CPU, not verl's three.

It is registered where verl looks it up: TRAINER_REGISTRY["sync"], inside the TaskRunner actor
(runner.RelayTaskRunner calls install()), never in the job's driver, whose registry the actor
never sees. verl's register_trainer refuses a second class under a name it has, and the trainer
mode must stay "sync" (verl tests `trainer_mode != "sync"` in several places), so install() swaps
the entry itself, after checking that it holds verl's PPOTrainerSync.

Everything verl-related is imported inside functions: this module is imported on the cluster only.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relay.common.faultpoint import fault_point
from relay.runs import heartbeat, layout
from relay.runs.lease import Lease
from relay.runs.metrics import MetricsLog
from relay.runs.phases import record_phase
from relay.trainers.contract import ChunkRequest
from relay.trainers.session import ChunkSession
from relay.trainers.stopping import GracefulStop
from relay.trainers.verl_ppo import placement, tracking
from relay.trainers.verl_ppo.verl_contract import VerlContractError

PAYLOAD_KEY = "relay_chunk"  # top-level key the driver adds to verl's config; the TaskRunner pops it


@dataclass
class VerlChunk:
    """What the TaskRunner actor needs from the job's driver (travels inside verl's config, base64 JSON)."""

    request: str  # ChunkRequest JSON, with the lease token the driver holds
    resume_step: int  # the checkpoint Relay validated, that verl must resume from (0: fresh)
    end_step: int  # the loop stops here (the chunk's end; the run's total in supervised mode)
    total_steps: int  # the run's total: the LR schedule's horizon, and the run's real end
    strategy: str  # horizon.LOOP_BOUND or horizon.TOTAL_STEPS
    validate_chunk_end: bool = False
    test_freq: int = -1
    tracking_env: dict = field(default_factory=dict)  # WANDB_RUN_ID, WANDB_RESUME, MLFLOW_RUN_ID...
    run_dir: str = ""

    def encode(self) -> str:
        return base64.b64encode(json.dumps(asdict(self), sort_keys=True).encode()).decode()

    @classmethod
    def decode(cls, blob: str) -> VerlChunk:
        return cls(**json.loads(base64.b64decode(blob)))

    def skip_validation_at(self, step: int) -> bool:
        """verl validates on its last step; only the run's real end (or test_freq, or a spec asking for it) does."""
        return (step == self.end_step and step < self.total_steps and not self.validate_chunk_end
                and not (self.test_freq > 0 and step % self.test_freq == 0))


def attach(config, chunk: VerlChunk) -> None:
    """Put the chunk into verl's config (outside verl's schema; popped before verl reads the config)."""
    from omegaconf import open_dict

    with open_dict(config):
        config[PAYLOAD_KEY] = chunk.encode()


def detach(config) -> VerlChunk | None:
    from omegaconf import open_dict

    if PAYLOAD_KEY not in config:
        return None
    with open_dict(config):
        blob = config.pop(PAYLOAD_KEY)
    return VerlChunk.decode(blob)


# -------------------------------------------------------------------------------- the subclass
_ACTIVE: VerlChunk | None = None
_CLASS = None


def active_chunk() -> VerlChunk:
    if _ACTIVE is None:
        from relay.common.errors import RelayError

        raise RelayError("RelayChunkTrainer was built without a chunk (install() was not called in this process)",
                         "run verl through relay.trainers.verl_ppo (the TaskRunner installs the chunk)",
                         retry_helps=False)
    return _ACTIVE


def trainer_class():
    """RelayChunkTrainer, a subclass of verl's PPOTrainerSync (built on first use: it imports verl)."""
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    class RelayChunkTrainer(PPOTrainerSync):
        """verl's sync trainer for one chunk of a Relay run (see the module's docstring)."""

        __relay_chunk__ = True
        total_training_steps: int  # set by verl's _init_dataloader (mypy takes verl's trainer as Any)

        def __init__(self, config):
            super().__init__(config)
            self.relay = active_chunk()
            self.relay_session = _actor_session(self.relay)
            self._relay_phase("trainer_built")

        def _relay_phase(self, phase: str) -> None:
            """A start-up mark in events.jsonl (relay.runs.phases): where a verl chunk's start-up goes."""
            req = self.relay_session.req
            record_phase(self.relay.run_dir, phase, chunk=req.chunk, attempt=req.attempt)

        # ---- workers that can be placed, or a loud failure
        def _init_resource_pool_mgr(self):
            super()._init_resource_pool_mgr()
            from verl.utils.device import get_device_name, get_resource_name

            m = self.resource_pool_manager
            if get_device_name() == "cpu":
                # verl reserves 3 CPUs per worker (ResourcePoolManager.max_colocate_count, not in its config: one
                # process each for actor, rollout and reward model); on the CPU path the one hybrid worker process
                # does all three, and a laptop's head has few CPUs to spare.
                m.max_colocate_count = 1
            placement.check(m.resource_pool_spec, m.max_colocate_count, get_resource_name(), placement.ray_nodes())

        # ---- the loop bound, never the horizon
        def _init_dataloader(self):
            super()._init_dataloader()
            c = self.relay
            horizon = c.total_steps * self.parameter_sync_step
            optim_horizon = self.config.actor_rollout_ref.actor.optim.total_training_steps
            if c.strategy == "loop_bound":
                if self.total_training_steps != c.total_steps or optim_horizon != horizon:
                    from relay.trainers.verl_ppo.horizon import HorizonError

                    raise HorizonError(
                        f"verl set total_training_steps {self.total_training_steps} and the optimizer horizon "
                        f"{optim_horizon}; Relay expected the run's {c.total_steps} (x parameter_sync_step "
                        f"{self.parameter_sync_step}). The LR schedule's horizon cannot be guaranteed: refused",
                        "check trainer.total_training_steps in the overrides; pin verl 0.9.1")
                # Lower only the loop bound: the horizon was written above, and the workers' schedulers
                # are built from it after this returns.
                self.total_training_steps = c.end_step
            elif self.total_training_steps != c.end_step:
                from relay.trainers.verl_ppo.horizon import HorizonError

                raise HorizonError(f"verl's loop bound is {self.total_training_steps}, the chunk ends at {c.end_step}")
            _say(f"chunk trainer: loop stops at step {self.total_training_steps}; LR horizon {optim_horizon} "
                 f"optimizer steps (run total {c.total_steps}, {c.strategy})")
            self._relay_phase("dataloader_ready")

        # ---- resume: verl must resume from the checkpoint Relay validated
        def _load_checkpoint(self):
            self._relay_phase("workers_ready")  # verl calls this last in _setup, after workers and rollout
            if self.relay.resume_step:
                # verl's loader unpickles (weights_only=False): it reads only the bytes Relay validated.
                from relay.checkpoints.manifest import unchanged_since_validation
                from relay.runs import layout

                unchanged_since_validation(layout.step_dir(self.relay.run_dir, self.relay.resume_step))
            super()._load_checkpoint()
            if self.global_steps != self.relay.resume_step:
                from relay.common.errors import CheckpointError

                raise CheckpointError(
                    f"verl resumed at step {self.global_steps}, but Relay validated step {self.relay.resume_step} "
                    f"in {self.config.trainer.default_local_dir}: the tracker and the folders disagree",
                    "run `python -m relay doctor SPEC --run RUN` and retry the chunk")
            _say(f"verl resumed at step {self.global_steps}" if self.global_steps else "verl starts at step 0")
            self._relay_phase("checkpoint_loaded")

        def on_init_end(self):
            super().on_init_end()  # verl's sync trainer hands the (loaded) weights to the rollout here
            self._relay_phase("weights_synced")

        # ---- validation: only at the run's real end unless asked
        def _validate(self, *args, **kwargs):
            if self.relay.skip_validation_at(self.global_steps):
                _say(f"step {self.global_steps} ends the chunk, not the run: validation skipped "
                     "(validate_every_chunk: false)")
                return {}
            return super()._validate(*args, **kwargs)

        # ---- saving: verl's own save into staging, then Relay's fenced commit
        def _save_checkpoint(self):
            from omegaconf import open_dict

            step = self.global_steps
            session = self.relay_session
            real_dir = self.config.trainer.default_local_dir
            with session.saving(step) as staging_root:  # checks the lease; a failed save is removed
                with open_dict(self.config):
                    self.config.trainer.default_local_dir = str(staging_root)
                try:
                    super()._save_checkpoint()
                finally:
                    with open_dict(self.config):
                        self.config.trainer.default_local_dir = real_dir
                staged = layout.step_dir(staging_root, step)
                remove_rollout_state(staged)
                session.commit(step, staged)

            shutil.rmtree(staging_root, ignore_errors=True)

        # ---- every step: the lease and one metrics row, with the dataset indices the step trained on
        def _next_train_batch(self, num_prompts=None):
            batch = super()._next_train_batch(num_prompts)  # verl fetches each step's prompts as the step begins
            self._relay_indices = sample_indices(batch)
            if self._relay_indices is not None:
                self._relay_uid_index = dict(zip(_plain(batch["uid"]), self._relay_indices, strict=True))
            return batch

        # ---- the step's batch in one order, whatever order its responses were generated in
        def _balance_batch(self, batch, metrics, *args, **kwargs):
            order = canonical_order(batch.keys, getattr(self, "_relay_uid_index", {}))
            if order is not None:
                batch.reorder(order)
            return super()._balance_batch(batch, metrics, *args, **kwargs)

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
            self._relay_step_done(global_steps, epoch, metrics, timing_raw)

        def _relay_step_done(self, step, epoch, metrics, timing_raw):
            row = metrics_row(metrics)
            indices = getattr(self, "_relay_indices", None)
            if indices is not None:
                row["sample_indices"] = indices
            self.relay_session.record_step(step, float(timing_raw.get("step", 0.0)), epoch=epoch, **row)

        def on_train_begin(self):
            super().on_train_begin()
            _record_tracking(self)
            self._relay_phase("first_step_begins")
            if why := self.relay_session.stop_reason():  # save_before too close for a step and its save
                last = self.global_steps - 1  # verl counts from the step it is about to train
                self.total_training_steps = last  # verl's loop (global_steps <= total_training_steps) never runs
                self.relay_session.record_stop(last, why)
                _say(f"stopping before step {self.global_steps} ({why})")

        # ---- a graceful stop: verl's own save of this step, then its loop ends (relay.trainers.stopping)
        def on_step_begin(self):
            super().on_step_begin()
            self._relay_step_began = time.time()

        def on_step_end(self):
            super().on_step_end()  # verl's sync trainer hands the updated weights to the rollout here
            if self.global_steps >= self.total_training_steps:
                return  # the chunk's last step: verl saves it and ends anyway
            fault_point("verl_step_end", self.global_steps)  # the fault suite's hook: a stop request lands here
            began = getattr(self, "_relay_step_began", None)
            # the driver's stop file (its SIGTERM), or save_before against this step's time and the last save's
            why = self.relay_session.stop_reason(time.time() - began if began else None)
            if why is None:
                return
            save_freq = self.config.trainer.save_freq
            if not (save_freq > 0 and self.global_steps % save_freq == 0):  # not saved by verl's loop just now
                self._save_checkpoint()
            # verl's loop runs while global_steps <= total_training_steps: it ends after this step.
            self.total_training_steps = self.global_steps
            self.relay_session.record_stop(self.global_steps, why)
            _say(f"stopping after step {self.global_steps} ({why}): its checkpoint is committed")

    RelayChunkTrainer.__module__ = __name__
    RelayChunkTrainer.__qualname__ = "RelayChunkTrainer"
    _CLASS = RelayChunkTrainer
    return _CLASS


def install(chunk: VerlChunk) -> type:
    """In the TaskRunner actor: make verl's trainer lookup ("sync") return RelayChunkTrainer for this chunk."""
    global _ACTIVE
    from verl.trainer.ppo.v1 import get_trainer_cls, trainer_base
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    cls = trainer_class()
    current = trainer_base.TRAINER_REGISTRY.get("sync")
    if current is not cls and current is not PPOTrainerSync:
        raise VerlContractError(f"verl's TRAINER_REGISTRY['sync'] holds {current!r}, not verl's PPOTrainerSync: "
                                "another plugin replaced it; Relay will not overwrite it",
                                "remove the other registration, or run this spec without it")
    _ACTIVE = chunk
    trainer_base.TRAINER_REGISTRY["sync"] = cls
    if get_trainer_cls("sync") is not cls:
        raise VerlContractError("verl's get_trainer_cls('sync') does not return the registry's entry",
                                "pin verl 0.9.1 (Relay's contract tests)")
    return cls


# -------------------------------------------------------------------------------- helpers
# verl writes these into a step folder for its async modes (in-flight rollouts); a sync trainer never
# loads them, and they are not model state. Relay keeps them out of its checkpoints.
ROLLOUT_STATE = ("transfer_queue",)


def remove_rollout_state(step_dir: Path) -> list[str]:
    removed = []
    for name in ROLLOUT_STATE:
        p = Path(step_dir) / name
        if p.exists():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(name)
    return removed


# metrics.jsonl column <- verl metric names, first present wins
METRICS = {
    "reward_mean": ("critic/score/mean", "critic/rewards/mean"),
    "loss": ("actor/pg_loss", "actor/loss"),
    "kl": ("actor/kl_loss", "actor/ppo_kl"),
    "lr": ("actor/lr",),
    "entropy": ("actor/entropy",),
    "response_length": ("response_length/mean",),
}


def metrics_row(metrics: dict) -> dict[str, float]:
    out = {}
    for column, names in METRICS.items():
        for n in names:
            v: Any = metrics.get(n)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[column] = float(v)
                break
            if hasattr(v, "item"):
                try:
                    out[column] = float(v.item())
                    break
                except (TypeError, ValueError):
                    continue
    return out


def _plain(values) -> list:
    """A TensorDict column (tensor, numpy array or stack of non-tensor data) as a list of plain values."""
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    return [getattr(v, "data", v) for v in values]


def sample_indices(batch) -> list[int] | None:
    """The dataset rows of a prompt batch (RLHFDataset's `index`, from extra_info.index), in batch order."""
    try:
        return [int(v) for v in _plain(batch["index"])]
    except KeyError:
        return None


def canonical_order(keys: list[str], uid_index: dict[str, int]) -> list[int] | None:
    """The positions of a step's samples sorted by (dataset index, place in the GRPO group, turn).

    verl's agent loop stores each response in TransferQueue under `{uid}_{session_id}_{turn}` as it finishes,
    and the step's batch comes back in that order, which depends on timing. The loss sums over the batch
    in its order, and a float sum in another order differs in its last bits, which Adam can turn into
    whole updates of a parameter whose gradient is near 0: two runs of the same data would not train alike.
    Sorted, they do. None when a key does not have that form (verl changed it): the order is left alone."""
    ranks = []
    for pos, key in enumerate(keys):
        uid, _, rest = str(key).partition("_")
        session, _, turn = rest.partition("_")
        if uid not in uid_index or not session.isdigit() or not turn.isdigit():
            return None
        ranks.append((uid_index[uid], int(session), int(turn), pos))
    return [pos for *_, pos in sorted(ranks)]


def _say(msg: str) -> None:
    print(f"[relay-verl] {msg}", flush=True)


def _actor_session(chunk: VerlChunk):
    """The parts of ChunkSession the actor needs: the lease (held by the driver, checked here), the
    staged and fenced commit, metrics rows. No resume: the driver validated it already."""

    class ActorSession(ChunkSession):
        def __init__(self, req: ChunkRequest, resume_step: int):  # no super().__init__: nothing to resume
            self.req, self.spec, self.run_dir = req, req.spec, req.run_dir
            self.lease = Lease(self.run_dir, incarnation=req.run.incarnation)
            assert req.lease_token is not None  # the driver took the lease: its token travels in the request
            self.token = req.lease_token
            self.lease.check(self.token)
            self.resume_step = resume_step
            self.metrics = MetricsLog(self.run_dir)
            self._t0 = time.time()
            self._step_times = []
            # Not signalled here (Ray signals the job's driver): the driver's stop file and save_before
            self.stopping = GracefulStop(self.run_dir, req.attempt, self.spec.deadline(), signals=False)
            self._save_started = None
            self._save_s = None

        def record_step(self, step: int, seconds: float, **values) -> None:
            """One metrics.jsonl row (the driver prints the progress line); stop at once if the lease was lost."""
            self.lease.check(self.token)
            self._step_times.append(seconds)
            self.metrics.append({"step": step, "chunk": self.req.chunk, "attempt": self.req.attempt,
                                 "seconds": round(seconds, 4), "time": time.time(), **values})
            heartbeat.beat(self.run_dir, self.req.attempt, step)

    return ActorSession(ChunkRequest.from_json(chunk.request), chunk.resume_step)


def _record_tracking(trainer) -> None:
    """Keep the tracking run ids of this run (the MLflow run verl started in chunk 1 is reused later)."""

    try:
        tracking.record_active(Path(trainer.relay.run_dir), trainer.config.trainer.logger)
    except Exception as e:  # noqa: BLE001 - tracking is never worth failing a chunk over
        _say(f"could not record the tracking run id: {e}")
