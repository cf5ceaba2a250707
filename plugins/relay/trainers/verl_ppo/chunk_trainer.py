"""verl's v1 trainers, made to stop at a chunk's end step without moving the LR schedule's horizon.

RelayChunk holds what Relay changes in verl's PPOTrainer, for each trainer mode: RelayChunkTrainer is it over
verl's own PPOTrainerSync, RelayColocateAsyncTrainer over PPOTrainerColocateAsync and RelaySeparateAsyncTrainer over
PPOTrainerSeparateAsync with the async rule of relay.trainers.verl_ppo.async_trainer (prompts generated under the
weights they were handed out with, trained first in, first out, the ones in flight saved and restored). It changes
only this:

- `_init_dataloader`: verl computes total_training_steps (the run's total, from the override) and
  writes the optimizer horizon from it; then, and only then, the loop bound `self.total_training_steps`
  is lowered to the chunk's end. The workers, and so their LR schedulers, are built after this
  (PPOTrainer._setup), from the horizon verl wrote. verl's fit() then stops at the chunk's end,
  treating it as its last step: it saves there (save_freq > 0 is always set).
- `_validate`: verl validates on its last step; a chunk's end is not the run's end, so validation
  there is skipped unless the spec asks for it (validate_every_chunk) or test_freq falls on it.
- `_load_checkpoint`: the step verl resumes from must be the one Relay validated just before.
- `_save_checkpoint`: verl's own save, into Relay's staging folder, then the checkpoint's certificate (computed
  in verl's workers: relay.trainers.verl_ppo.certify), then the fenced commit (rename to global_step_N, tracker
  written atomically, holding the run's lease), as every Relay trainer does. `_load_checkpoint` checks the
  certificate after verl loaded it, before the first step. With checkpoints.async_save the workers write their
  shards on threads of their own (relay.trainers.verl_ppo.worker_saves; with FSDP2 they digest their copies there,
  and only the certificate's probe runs while training waits) and the session's save thread commits;
  the loop's last row, a graceful stop, a handoff and `on_train_end` wait for that commit.
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

It is registered where verl looks it up: TRAINER_REGISTRY[<trainer_mode>], inside the TaskRunner actor
(runner.RelayTaskRunner calls install()), never in the job's driver, whose registry the actor
never sees. verl's register_trainer refuses a second class under a name it has, and the trainer
mode must stay verl's name (verl tests `trainer_mode != "sync"` in several places), so install() swaps
the entry itself, after checking that it holds verl's own class of that mode.

It imports verl at module level: only the TaskRunner actor (runner.RelayTaskRunner.run) and the tests import
it; what the job's driver needs of a chunk is in verl_chunk, which imports no verl.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from verl.trainer.ppo.checkpoint_callback import CheckpointCallback
from verl.trainer.ppo.v1 import get_trainer_cls, trainer_base
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from relay.common.faultpoint import fault_point
from relay.runs import layout
from relay.runs.metrics import record_event
from relay.runs.phases import record_phase
from relay.trainers.verl_ppo import certify, placement, verl_chunk
from relay.trainers.verl_ppo.async_trainer import AsyncPrompts
from relay.trainers.verl_ppo.verl_contract import VerlContractError


class RelayChunk(PPOTrainer):
    """What Relay changes in verl's trainer for one chunk of a run, whatever its mode (see the module's docstring)."""

    __relay_chunk__ = True
    total_training_steps: int  # set by verl's _init_dataloader (mypy takes verl's trainer as Any)
    _relay_indices: list[int] | None  # the dataset rows the step trained (sync: its fetch; async: its batch)

    def __init__(self, config):
        super().__init__(config)
        self.relay = verl_chunk.active_chunk()
        self.relay_session = verl_chunk.actor_session(self.relay)
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
                    "check trainer.total_training_steps in the overrides; pin verl 0.9.1",
                )
            # Lower only the loop bound: the horizon was written above, and the workers' schedulers
            # are built from it after this returns.
            self.total_training_steps = self._relay_loop_bound()
        elif self.total_training_steps != c.end_step:
            from relay.trainers.verl_ppo.horizon import HorizonError

            raise HorizonError(f"verl's loop bound is {self.total_training_steps}, the chunk ends at {c.end_step}")
        else:
            self.total_training_steps = self._relay_loop_bound()
        verl_chunk.say(
            f"chunk trainer: loop stops at step {self.total_training_steps}; LR horizon {optim_horizon} "
            f"optimizer steps (run total {c.total_steps}, {c.strategy})"
        )
        self._relay_phase("dataloader_ready")

    def _relay_loop_bound(self) -> int:
        """The chunk's end; with warm chunks one chunk further (never past the run's end), so that verl's loop does
        not end at the chunk's end (its last step returns from fit): the chunk's end is saved by save_freq, and
        the loop is ended there (the bound lowered to it) unless the job goes on warm (_relay_hand_off)."""
        c = self.relay
        return min(c.total_steps, c.end_step + c.warm_chunk_steps) if c.warm_chunk_steps else c.end_step

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
                "run `python -m relay doctor SPEC --run RUN` and retry the chunk",
            )
        verl_chunk.say(f"verl resumed at step {self.global_steps}" if self.global_steps else "verl starts at step 0")
        if self.relay.resume_step:
            self._relay_after_load(self.relay.resume_step)
            self._relay_certify_resume(self.relay.resume_step)
        self._relay_phase("checkpoint_loaded")

    def _relay_after_load(self, step: int) -> None:
        """After verl loaded step's checkpoint (the async modes check the prompts in flight it restored)."""

    # ---- certificates: written at every save, checked at every resume (relay.checkpoints.certificate)
    def _relay_pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad if pad is not None else getattr(self.tokenizer, "eos_token_id", 0) or 0)

    def _relay_certify_save(self, staged, step: int, *, digests: bool = True):
        """The certificate of what verl just saved, into the staged step folder (before the commit). A certificate
        that cannot be computed never fails the save: its commit records why, and the step may resume uncertified.
        `digests=False` (a save off the critical path): the probe only, returned for the save's thread to complete
        with the digests of the workers' copies (_relay_certify_later); nothing written yet."""
        try:
            if getattr(self, "_relay_probe_ids", None) is None:
                self._relay_probe_ids = certify.probe_ids(self.train_dataset, self.tokenizer, self.relay_session.spec.seed)
            cert = certify.certificate_of(self, step, self._relay_probe_ids, self._relay_pad_id(), digests)
        except Exception as e:  # noqa: BLE001 - whatever verl's workers raised: the save itself stands
            self.relay_session.no_certificate(step, f"{type(e).__name__}: {e}")
            return None
        if not digests:
            return cert
        cert.write(staged)
        verl_chunk.say(f"certificate of step {step}: {cert.summary()}")
        return cert

    def _relay_certify_later(self, staged, step: int, probed, results: list[dict]) -> None:
        """On the save's thread: the certificate whose probe ran at the save, with the digests the workers took of
        their copies (worker_saves.summed), into the staged folder before the commit; or the commit records why not."""
        from dataclasses import replace

        from relay.trainers.verl_ppo import worker_saves

        if probed is None:
            return  # the probe failed: no_certificate said why
        try:
            params, moments, steps = worker_saves.summed(results)
        except RuntimeError as e:
            self.relay_session.no_certificate(step, f"its digests could not be taken from the saved copies: {e}")
            return
        cert = replace(probed, params=params, optimizer=moments, optimizer_steps=steps)
        cert.write(staged)
        verl_chunk.say(f"certificate of step {step}: {cert.summary()} (digests from the saved copies)")

    def _relay_certify_resume(self, step: int) -> None:
        """After verl's load, before the first step: the workers' certificate of what they loaded against the saved
        one (ChunkSession.certify: refused, quarantined and fallen back when it does not hold)."""
        session = self.relay_session
        session.certify(
            layout.step_dir(self.relay.run_dir, step),
            lambda ids: certify.certificate_of(self, step, ids, self._relay_pad_id()),
        )
        req = session.req
        record_event(
            session.run_dir,
            "resume_certificate",
            chunk=req.chunk,
            attempt=req.attempt,
            step=step,
            certificate=session.certificate,
            seconds=getattr(session, "_certify_s", None),
        )

    def on_init_end(self):
        super().on_init_end()  # verl's sync trainer hands the (loaded) weights to the rollout here
        self._relay_phase("weights_synced")

    # ---- validation: only at the run's real end unless asked
    def _validate(self, *args, **kwargs):
        if self.relay.skip_validation_at(self.global_steps):
            verl_chunk.say(
                f"step {self.global_steps} ends the chunk, not the run: validation skipped (validate_every_chunk: false)"
            )
            return {}
        return super()._validate(*args, **kwargs)

    # ---- saving: verl's own save into staging, then Relay's fenced commit
    def _save_checkpoint(self):
        step = self.global_steps
        session = self.relay_session
        self._relay_before_save(step)
        if session.spec.checkpoints.async_save:  # the copy now; the files and the commit while the next steps train
            session.save_off_critical_path(step, lambda staging_root: self._relay_snapshot(staging_root, step))
            return
        with session.saving(step) as staging_root:  # checks the lease; a failed save is removed
            staged = self._relay_verl_save(staging_root)
            self._relay_staged(staged, step)
            self._relay_certify_save(staged, step)
            session.commit(step, staged)

        shutil.rmtree(staging_root, ignore_errors=True)

    def _relay_verl_save(self, staging_root) -> Path:
        """verl's own save (actor, critic, data.pt, the async modes' transfer_queue/), into Relay's staging folder.
        Returns the step folder verl wrote, as its checkpoint callback (RelaySaved) named it."""
        from omegaconf import open_dict

        step = self.global_steps
        expected = layout.step_dir(staging_root, step)
        self._relay_written: Path | None = None
        real_dir = self.config.trainer.default_local_dir
        with open_dict(self.config):
            self.config.trainer.default_local_dir = str(staging_root)
        try:
            super()._save_checkpoint()
        finally:
            with open_dict(self.config):
                self.config.trainer.default_local_dir = real_dir
        if self._relay_written != expected:
            raise VerlContractError(
                f"verl's save of step {step} named {self._relay_written or 'no folder'} to its checkpoint callback "
                f"(trainer.checkpoint_callback_class), not {expected}: Relay cannot tell what verl wrote",
                "run the verl version Relay's contract names (`relay doctor SPEC`), and keep "
                "trainer.checkpoint_callback_class as Relay sets it",
            )
        return expected

    def _relay_saved(self, step: int, checkpoint_dir: Path) -> None:
        """verl's checkpoint callback (RelaySaved): its save of `step` returned, into `checkpoint_dir`."""
        self._relay_written = checkpoint_dir if step == self.global_steps else None

    def _relay_snapshot(self, staging_root, step: int):
        """A save off the critical path (checkpoints.async_save; relay.trainers.verl_ppo.worker_saves): verl's save
        with every worker's checkpoint manager's torch.save deferred into its host buffers, then the certificate's
        probe of the weights saved (now, before they change); each worker writes its files on a thread of its own
        and, with FSDP2, digests its copies there for the certificate. Returns the writes for the session's save
        thread: wait until every worker wrote and fsynced its files, then the step folder to commit."""
        import ray

        from relay.trainers.verl_ppo import worker_saves

        workers = self._relay_save_workers()
        # FSDP2's shards are digested from the workers' copies on their write threads; FSDP1's flat parameters, on
        # the training thread, as a synchronous save does (its optimizer's sharded state is keyed otherwise)
        later = self.relay_session.spec.settings.fsdp_version == 2
        actors = len(self.actor_rollout_wg.workers)
        ray.get([w.__ray_call__.remote(worker_saves.defer, step, later and i < actors) for i, w in enumerate(workers)])
        done = [Path(staging_root) / f".written-{i}.json" for i in range(len(workers))]
        try:
            staged = self._relay_verl_save(staging_root)
        finally:  # every worker's torch.save is its own again, whatever happened
            took = ray.get(
                [w.__ray_call__.remote(worker_saves.write_behind, str(d)) for w, d in zip(workers, done, strict=True)]
            )
        for t in took:
            for why in t["written_now"]:
                verl_chunk.say(f"step {step}: {why}; written before training went on")
        self._relay_staged(staged, step)
        probed = self._relay_certify_save(staged, step, digests=not later)  # the probe: it needs the live model

        def write():
            results = worker_saves.wait_written(done, lambda: self._relay_gone(workers))
            if later:
                self._relay_certify_later(staged, step, probed, results)
            for d in done:
                d.unlink()
            return staged

        return write

    def _relay_save_workers(self) -> list:
        """The Ray actors that write a checkpoint's shards, each once: the actor's workers, and the critic's where there
        is one (verl colocates the roles in the same actors: each then saves both, worker_saves.checkpoint_managers)."""
        groups = [self.actor_rollout_wg] + ([self.critic_wg] if getattr(self, "use_critic", False) else [])
        return list(dict.fromkeys(w for g in groups for w in g.workers))  # Ray's handles compare by actor id

    @staticmethod
    def _relay_gone(workers) -> str | None:
        """A worker that no longer answers, named (None when all do; one busy training answers later, and counts as
        alive)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        from relay.trainers.verl_ppo import worker_saves

        for i, w in enumerate(workers):
            try:
                ray.get(w.__ray_call__.remote(worker_saves.ping), timeout=10)
            except GetTimeoutError:
                continue
            except RayActorError as e:
                return f"worker {i} ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        return None

    def on_train_end(self):
        super().on_train_end()
        self.relay_session.wait_for_save()  # the loop ended before its bound (a stop): its save is committed first

    def _relay_before_save(self, step: int) -> None:
        """Before verl saves step (the async modes' fault point that loses prompts in flight)."""

    def _relay_staged(self, staged, step: int) -> None:
        """verl's save of step, staged, before its certificate and commit: the sync trainer keeps no rollout state
        (verl's transfer_queue/ holds nothing a sync resume loads); the async modes add their prompt ledger."""
        verl_chunk.remove_rollout_state(staged)

    # ---- every step: the lease and one metrics row, with the dataset indices the step trained on
    def _next_train_batch(self, num_prompts=None):
        batch = super()._next_train_batch(num_prompts)  # verl fetches each step's prompts as the step begins
        self._relay_indices = verl_chunk.sample_indices(batch)
        if self._relay_indices is not None:
            self._relay_uid_index = dict(zip(verl_chunk.plain_values(batch["uid"]), self._relay_indices, strict=True))
        return batch

    # ---- the step's batch in one order, whatever order its responses were generated in
    def _balance_batch(self, batch, metrics, *args, **kwargs):
        order = verl_chunk.canonical_order(batch.keys, getattr(self, "_relay_uid_index", {}))
        if order is not None:
            batch.reorder(order)
        return super()._balance_batch(batch, metrics, *args, **kwargs)

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        self._relay_step_done(global_steps, epoch, metrics, timing_raw)

    def _relay_step_done(self, step, epoch, metrics, timing_raw):
        row = {**verl_chunk.metrics_row(metrics), **self._relay_trained_fields()}
        self.relay_session.record_step(step, float(timing_raw.get("step", 0.0)), epoch=epoch, **row)
        if step >= self.total_training_steps:  # verl's fit returns after this row: its last save committed first
            self.relay_session.wait_for_save()
        if self.relay.warm_chunk_steps and step == self.relay.end_step < self.relay.total_steps:
            self._relay_hand_off(step)

    def _relay_trained_fields(self) -> dict:
        """The prompts the step trained, for its metrics row: their dataset indices (sync: the step's own fetch)."""
        indices = getattr(self, "_relay_indices", None)
        return {} if indices is None else {"sample_indices": indices}

    # ---- a warm handoff: the chunk's end is saved and committed; the loop goes on into the next chunk
    def _relay_hand_off(self, step: int) -> None:
        """After the chunk's last step (saved by verl's save_freq, committed, its row recorded) and before verl's
        loop tests its bound: the session goes on into the next chunk (ChunkSession.hand_off: nothing of it
        committed before its train task admits it) and the bound moves one chunk further; or the job ends here,
        the bound lowered to this step (as a graceful stop ends verl's loop)."""
        session = self.relay_session
        if not session.hand_off(step):
            self.total_training_steps = step
            return
        self.relay.end_step = session.req.to_step
        self.total_training_steps = self._relay_loop_bound()
        verl_chunk.say(f"chunk {session.req.chunk} goes on warm in this trainer, to step {session.req.to_step}")

    def on_train_begin(self):
        super().on_train_begin()
        verl_chunk.record_tracking(self)
        if self.relay_session.spec.checkpoints.async_save:  # the host buffers of saves, before the first step
            import ray

            from relay.trainers.verl_ppo import worker_saves

            said = ray.get([w.__ray_call__.remote(worker_saves.prepare) for w in self._relay_save_workers()])
            verl_chunk.say(said[0] + (f" (in each of {len(said)} workers)" if len(said) > 1 else ""))
        self._relay_phase("first_step_begins")
        if why := self.relay_session.stop_reason():  # save_before too close for a step and its save
            last = self.global_steps - 1  # verl counts from the step it is about to train
            self.total_training_steps = last  # verl's loop (global_steps <= total_training_steps) never runs
            self.relay_session.record_stop(last, why)
            verl_chunk.say(f"stopping before step {self.global_steps} ({why})")

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
        self.relay_session.wait_for_save()  # committed before the stop is recorded
        # verl's loop runs while global_steps <= total_training_steps: it ends after this step.
        self.total_training_steps = self.global_steps
        self.relay_session.record_stop(self.global_steps, why)
        verl_chunk.say(f"stopping after step {self.global_steps} ({why}): its checkpoint is committed")


class RelaySaved(CheckpointCallback):
    """verl's public hook after each save (`trainer.checkpoint_callback_class`, set by overrides.chunk_overrides),
    called in this actor once verl's save returned whole: it tells the chunk trainer which step folder verl wrote,
    which Relay then certifies and commits."""

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, async_save: bool = False, **kwargs) -> None:
        relay_saved = getattr(trainer, "_relay_saved", None)
        if relay_saved is None:
            raise VerlContractError(
                f"{type(trainer).__name__} is not Relay's chunk trainer: Relay's checkpoint callback has nothing to "
                "commit into",
                "start main_ppo through Relay's entrypoint (`relay train SPEC`, or the DAG)",
            )
        relay_saved(global_step, Path(checkpoint_dir))


class RelayChunkTrainer(RelayChunk, PPOTrainerSync):
    """verl's sync trainer for one chunk of a Relay run."""


class RelayColocateAsyncTrainer(AsyncPrompts, RelayChunk, PPOTrainerColocateAsync):
    """verl's colocate_async trainer for one chunk of a Relay run, resumed exactly (see async_trainer)."""


class RelaySeparateAsyncTrainer(AsyncPrompts, RelayChunk, PPOTrainerSeparateAsync):
    """verl's separate_async trainer for one chunk of a Relay run, resumed exactly (see async_trainer): the rollout
    on its own workers, given the weights after every step through the spec's checkpoint engine."""

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()  # the training pool checked (RelayChunk), then the rollout's own
        from verl.utils.device import get_resource_name

        rollout = self.config.actor_rollout_ref.rollout
        placement.check_separate_rollout(
            self.resource_pool_manager.resource_pool_spec,
            self.resource_pool_manager.max_colocate_count,
            [rollout.n_gpus_per_node] * rollout.nnodes,
            get_resource_name(),
            placement.ray_nodes(),
        )


# trainer_mode -> (Relay's class, verl's own class it replaces in verl's registry)
TRAINERS: dict[str, tuple[type, type]] = {
    "sync": (RelayChunkTrainer, PPOTrainerSync),
    "colocate_async": (RelayColocateAsyncTrainer, PPOTrainerColocateAsync),
    "separate_async": (RelaySeparateAsyncTrainer, PPOTrainerSeparateAsync),
}


def install(chunk: verl_chunk.VerlChunk) -> type:
    """In the TaskRunner actor: make verl's trainer lookup (the chunk's trainer_mode) return Relay's class for it."""
    mode = chunk.trainer_mode
    if mode not in TRAINERS:
        raise VerlContractError(
            f"Relay has no chunk trainer for verl's trainer_mode {mode!r}", f"use one of {sorted(TRAINERS)}"
        )
    cls, verls = TRAINERS[mode]
    current = trainer_base.TRAINER_REGISTRY.get(mode)
    if current is not cls and current is not verls:
        raise VerlContractError(
            f"verl's TRAINER_REGISTRY[{mode!r}] holds {current!r}, not verl's {verls.__name__}: "
            "another plugin replaced it; Relay will not overwrite it",
            "remove the other registration, or run this spec without it",
        )
    verl_chunk.activate(chunk)
    trainer_base.TRAINER_REGISTRY[mode] = cls
    if get_trainer_cls(mode) is not cls:
        raise VerlContractError(
            f"verl's get_trainer_cls({mode!r}) does not return the registry's entry",
            "pin verl 0.9.1 (Relay's contract tests)",
        )
    return cls
