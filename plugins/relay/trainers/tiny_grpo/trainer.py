"""A small, real GRPO trainer on CPU, built from verl's own parts.

- verl: the GRPO (or RLOO) outcome advantage from verl's estimator registry, the "vanilla" (clipped
  PPO) policy loss, kl_penalty and agg_loss from core_algos; its LR schedules; FSDPCheckpointManager
  to save (FSDP1 or FSDP2 over a gloo group of world size 1), so checkpoints are in verl's exact layout.
- torchdata's StatefulDataLoader with its RandomSampler, as verl uses, so data.pt is verl's.
- Resume goes through Relay's safe loader (weights_only), never verl's load_checkpoint, which
  unpickles with weights_only=False.

Determinism: threads are pinned by the spec, torch's deterministic algorithms are on, and every
RNG the trainer draws from is restored on resume: torch/numpy/python (verl's extra_state) and the
sampler's generator (data.pt). Rollouts sample with the global torch generator.
"""

from __future__ import annotations

import copy
import os
import random
import time
import warnings

from relay.checkpoints import safeload
from relay.checkpoints.validate import Skipped
from relay.common.faultpoint import fault_point
from relay.runs import layout
from relay.trainers import batches
from relay.trainers.contract import ChunkRequest, ChunkResult
from relay.trainers.session import ChunkSession, pin_threads
from relay.trainers.tiny_grpo import task


def _quiet_verl() -> None:
    """verl announces every optional engine it cannot import, and INFO-logs each file it saves."""
    warnings.filterwarnings("ignore", message=".*engine is not available")
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")


def resolved_settings(spec, train_rows: int | None = None) -> dict:
    """What the trainer derives from the spec and would run with, beyond the spec's own keys."""
    optim = spec.settings.optim
    return batches.resolved_settings(spec, train_rows, lr_schedule=f"{optim.schedule} (warmup {optim.warmup_steps} steps)")


def train_chunk(req: ChunkRequest) -> ChunkResult:
    _quiet_verl()
    spec = req.spec
    if spec.settings.world_size != 1:
        from relay.common.errors import SpecError

        raise SpecError(
            spec.source,
            "trainer.settings.world_size",
            f"the CPU trainer runs at world size 1, not {spec.settings.world_size}",
            "use world_size: 1 (verl's main_ppo trainer runs at any world size)",
        )
    pin_threads(spec.threads)
    session = ChunkSession(req)
    start = session.resume_step
    if start >= req.to_step:
        session.say(f"run {req.run.name} already reached step {start} >= {req.to_step}: nothing to train")
        return ChunkResult(req.run.name, start, start, 0, 0.0, str(layout.step_dir(session.run_dir, start)))
    resume_from = session.resume_checkpoint()

    t0 = time.time()
    trainer = _TinyGRPO(spec, session.data_files()["train"])
    if resume_from is not None:
        trainer.restore(resume_from)
        # After loading, before the first step: the state loaded is the state saved, or the resume is refused.
        session.certify(resume_from, lambda probe_ids: trainer.certificate(start, probe_ids))
    session.begin()
    if spec.checkpoints.async_save:
        session.say(trainer.prepare_host_buffers())
    checkpoint = None
    step = saved = start

    def save() -> None:
        nonlocal checkpoint, saved
        if spec.checkpoints.async_save:  # the copy now, the files and the commit while the next steps train
            session.save_off_critical_path(
                step, lambda staged: trainer.snapshot(staged, step), lambda staged: trainer.save(staged, step)
            )
            checkpoint = layout.step_dir(session.run_dir, step)
        else:
            with session.saving(step) as staged:
                trainer.save(staged, step)
                checkpoint = session.commit(step, staged)
        saved = step

    session.stopping.training_started()  # a SIGTERM now waits for the step's end and its save
    try:
        if (why := session.stop_reason()) is not None:  # save_before too close to train a step
            raise session.stopped_early(step, why)
        for batch in trainer.batches():
            step += 1
            t = time.time()
            values = trainer.train_step(batch, step)
            session.step_done(step, time.time() - t, epoch=trainer.epoch, **values)
            s = spec.settings
            if step == req.to_step or (s.save_freq and step % s.save_freq == 0):
                save()
            # The chunk's end: the job ends, or goes on warm with the next chunk's steps (spec chunks.handoff).
            if step == req.to_step and not session.hand_off(step):
                break
            # Asked to stop (SIGTERM, a stop request, save_before)? Before the next batch is drawn: the saved
            # dataloader state must be the one the next step starts from.
            if (why := session.stop_reason()) is not None:
                if saved < step:
                    save()
                raise session.stopped_early(step, why)
    finally:
        session.finish(step)
        trainer.close()
    return ChunkResult(req.run.name, start, step, step - start, time.time() - t0, str(checkpoint))


def build_model(settings):
    """The policy: a tiny Qwen2 decoder built from its config (no download), initialised from torch's RNG."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    m = settings.model
    config = Qwen2Config(
        vocab_size=len(task.VOCAB),
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
        bos_token_id=task.VOCAB[task.BOS],
        eos_token_id=task.VOCAB[task.EOS],
        pad_token_id=task.VOCAB[task.PAD],
    )
    config._attn_implementation = "eager"
    return Qwen2ForCausalLM(config)


def _checkpoint_model(spec, step_dir):
    """A fresh model with a checkpoint's weights (loaded safely), or Skipped at a world size the trainer never
    writes."""
    world_size = len(list((step_dir / "actor").glob("model_world_size_*_rank_*.pt")))
    if world_size != 1:
        raise Skipped(f"world size {world_size} (the CPU trainer trains at world size 1)")
    state = safeload.load(step_dir / "actor" / layout.shard_name("model", 1, 0), mmap=True)
    model = build_model(spec.settings)
    model.load_state_dict({k: v.to_local() if hasattr(v, "to_local") else v for k, v in state.items()})
    return model.eval()


def smoke(spec, step_dir) -> str:
    """Load a checkpoint's weights (safely) into a fresh model; one forward pass on a fixed prompt."""
    import torch

    model = _checkpoint_model(spec, step_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([task.encode_prompt("3+4=")])).logits
    if not bool(torch.isfinite(logits).all()):
        raise ValueError("the logits of the fixed prompt '3+4=' are not finite")
    return f"forward pass on '3+4=': finite logits, argmax next token {task.ID_TO_TOKEN[int(logits[0, -1].argmax())]!r}"


def certify(spec, step_dir, saved) -> str:
    """The checkpoint's model, loaded offline without FSDP, against its certificate: every parameter's digest
    exactly, the probe's log-probs within checkpoints.offline_tolerance (another forward path than the
    trainer's). The optimizer, data and RNG pieces are the trainer's to check at resume."""
    from dataclasses import replace

    from relay.checkpoints import certificate
    from relay.common.errors import CertificateError

    model = _checkpoint_model(spec, step_dir)
    logprobs = certificate.probe_logprobs(model, saved.probe_ids, saved.pad_id)
    now = replace(saved, device="offline", logprobs=logprobs, params=certificate.param_digests(model))
    c = certificate.compare(saved, now, spec.checkpoints.offline_tolerance)
    if not c.ok:
        raise CertificateError(f"the model of {step_dir.name} does not reproduce its certificate: {c.detail()}")
    return f"the model loaded offline reproduces its certificate: {len(now.params)} parameter digests equal, {c.detail()}"


PROBE_SEQUENCES = 4


def probe_sequences(rows: list[tuple[str, str]], seed: int) -> list[list[int]]:
    """The certificate's probe: a few rows of the training data, chosen by the run's seed alone (a generator of
    its own, none that training draws from), each its prompt and its answer as token ids."""
    picked = random.Random(f"relay-probe-{seed}").sample(range(len(rows)), min(PROBE_SEQUENCES, len(rows)))
    out = []
    for i in sorted(picked):
        prompt, truth = rows[i]
        out.append(
            task.encode_prompt(prompt) + [task.VOCAB.get(ch, task.VOCAB["<unk>"]) for ch in truth] + [task.VOCAB[task.EOS]]
        )
    return out


class _TinyGRPO:
    """Model, optimizer, schedule and data of one chunk's process."""

    def __init__(self, spec, train_files: list[str]):
        import numpy as np
        import torch
        import torch.distributed as dist
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import RandomSampler
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
        from verl.workers.config import ActorConfig

        self.torch = torch
        self.spec = spec
        s = self.s = spec.settings
        torch.set_num_threads(spec.threads)
        torch.use_deterministic_algorithms(True)
        if not dist.is_initialized():
            # World size 1: an in-process store, so two trainers on one host never contend for a port.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

        torch.manual_seed(spec.seed)
        np.random.seed(spec.seed)
        random.seed(spec.seed)
        model = build_model(s)
        # The reference policy for the KL loss is the initial model, rebuilt from the seed on every resume.
        self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.model = self._shard(model, s.fsdp_version)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=s.optim.lr, weight_decay=s.optim.weight_decay)
        self.scheduler = self._schedule()

        rows = task.load_rows(train_files)
        self.probe_ids = probe_sequences(rows, spec.seed)
        fn = s.custom_reward_function
        self.reward_fn = task.custom_reward(fn.path, fn.name) if fn.path else None
        self.prompts = torch.tensor([task.encode_prompt(p) for p, _ in rows])
        self.truths = [t for _, t in rows]
        if s.shuffle:
            gen = torch.Generator()
            gen.manual_seed(spec.seed)
            sampler = RandomSampler(range(len(rows)), generator=gen)
        else:
            sampler = torch.utils.data.SequentialSampler(range(len(rows)))
        # The loader's own generator keeps iter() from drawing on the global RNG (which rollouts use).
        loader_gen = torch.Generator()
        loader_gen.manual_seed(spec.seed)
        self.loader = StatefulDataLoader(
            list(range(len(rows))),
            batch_size=s.train_batch_size,
            sampler=sampler,
            drop_last=True,
            collate_fn=list,
            generator=loader_gen,
        )
        self.steps_per_epoch = len(self.loader)
        from relay.trainers.async_save import HostBuffers

        self.host_buffers = HostBuffers()  # saves off the critical path: kept from one save to the next
        self.epoch = 0
        self.ckpt = FSDPCheckpointManager(
            model=self.model,
            optimizer=self.optim,
            lr_scheduler=self.scheduler,
            processing_class=task.hf_tokenizer(),
            checkpoint_config=None,
        )
        self.actor_cfg = ActorConfig(
            strategy=f"fsdp{s.fsdp_version if s.fsdp_version == 2 else ''}",
            rollout_n=s.rollout_n,
            ppo_mini_batch_size=s.ppo_mini_batch_size,
            ppo_micro_batch_size_per_gpu=s.ppo_mini_batch_size * s.rollout_n,
            clip_ratio=s.clip_ratio,
            clip_ratio_low=s.clip_ratio,
            clip_ratio_high=s.clip_ratio,
        )

    def _shard(self, model, version: int):
        # A device mesh named as verl names it ("fsdp"), which verl's model merger expects.
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        if version == 2:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=mesh)
            return model
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(model, device_mesh=mesh, use_orig_params=True, device_id=self.torch.device("cpu"))

    def _schedule(self):
        from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

        o = self.s.optim
        if o.schedule == "cosine":
            # The horizon is the whole run's total, never a chunk's end.
            return get_cosine_schedule_with_warmup(
                self.optim, o.warmup_steps, self.spec.total_steps, min_lr_ratio=o.min_lr_ratio
            )
        return get_constant_schedule_with_warmup(self.optim, o.warmup_steps)

    # --------------------------------------------------------------------------------- data
    def batches(self):
        """Batches across epoch boundaries, continuing from the restored dataloader position."""
        while self.epoch < self.s.total_epochs:
            yield from self.loader
            self.epoch += 1

    # --------------------------------------------------------------------------------- step
    def _logprobs(self, model, seq, prompt_len):
        logits = model(input_ids=seq).logits[:, prompt_len - 1 : -1].float()
        return self.torch.log_softmax(logits, -1).gather(-1, seq[:, prompt_len:].unsqueeze(-1)).squeeze(-1)

    def score(self, response: str | None, row: int, step: int) -> float:
        truth = self.truths[row]
        if self.reward_fn is None:
            return task.reward(response, truth)
        return float(
            self.reward_fn("tiny_arith", response or "", truth, {"split": "train", "index": row, "global_step": step})
        )

    def train_step(self, batch: list[int], step: int = 0) -> dict[str, float]:
        import numpy as np
        from verl.trainer.ppo.core_algos import agg_loss, get_adv_estimator_fn, get_policy_loss_fn, kl_penalty

        torch, s = self.torch, self.s
        n = s.rollout_n
        prompts = self.prompts[batch].repeat_interleave(n, 0)
        rows = [i for i in batch for _ in range(n)]
        group = np.repeat(np.arange(len(batch)), n)
        plen = prompts.shape[1]

        # Rollout: sample responses from the current policy.
        self.model.eval()
        seq = prompts
        with torch.no_grad():
            for _ in range(s.max_response_length):
                logits = self.model(input_ids=seq).logits[:, -1].float() / s.temperature
                seq = torch.cat([seq, torch.multinomial(torch.softmax(logits, -1), 1)], 1)
        self.model.train()
        resp = seq[:, plen:]
        eos = (resp == task.VOCAB[task.EOS]).int()
        mask = ((eos.cumsum(1) - eos) == 0).float()  # tokens up to and including the first EOS
        rewards = torch.tensor(
            [self.score(task.decode_response(r.tolist()), i, step) for r, i in zip(resp, rows, strict=False)]
        )
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(len(rewards)), mask.sum(1).long() - 1] = rewards

        adv, _ = get_adv_estimator_fn(s.adv_estimator)(token_level_rewards=token_rewards, response_mask=mask, index=group)
        with torch.no_grad():
            old_lp = self._logprobs(self.model, seq, plen)
            ref_lp = self._logprobs(self.ref, seq, plen)
        policy_loss = get_policy_loss_fn("vanilla")
        mb = s.ppo_mini_batch_size * n
        losses, kls = [], []
        for i in range(0, len(seq), mb):
            sl = slice(i, i + mb)
            lp = self._logprobs(self.model, seq[sl], plen)
            pg_loss, _ = policy_loss(old_lp[sl], lp, adv[sl], mask[sl], "token-mean", self.actor_cfg)
            kl = agg_loss(kl_penalty(lp, ref_lp[sl], s.kl_loss_type), mask[sl], "token-mean")
            loss = pg_loss + s.kl_loss_coef * kl if s.use_kl_loss else pg_loss
            loss.backward()
            self.optim.step()
            self.optim.zero_grad(set_to_none=True)
            losses.append(loss.item())
            kls.append(kl.item())
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return {
            "reward_mean": rewards.mean().item(),
            "accuracy": (rewards == 1).float().mean().item(),
            "loss": sum(losses) / len(losses),
            "kl": sum(kls) / len(kls),
            "lr": lr,
        }

    # --------------------------------------------------------------------------------- checkpoints
    def save(self, folder, step: int) -> None:
        """verl's layout: actor/ via verl's FSDPCheckpointManager, then data.pt as verl's trainer saves it, then
        the certificate of what was saved (relay.checkpoints.certificate)."""

        self.ckpt.save_checkpoint(str(folder / "actor"), global_step=step)
        fault_point("mid_save", step)  # a test hook: a kill here leaves a half-written staging folder
        self.torch.save(self.loader.state_dict(), folder / "data.pt")
        self.certificate(step).write(folder)

    def snapshot(self, folder, step: int):
        """What save() writes, taken now (relay.trainers.async_save): verl's save code runs as in save(), its
        barriers and small files included, with each torch.save deferred into host buffers; then the certificate
        (its probe runs now). Returns the writes, for the save's thread: the same files, byte for byte."""
        from dataclasses import replace

        from relay.checkpoints import certificate
        from relay.trainers.async_save import DeferredWrites

        deferred = DeferredWrites(self.host_buffers)
        with deferred.intercepting(self.ckpt):  # verl's checkpoint manager, as in verl's workers
            self.ckpt.save_checkpoint(str(folder / "actor"), global_step=step)
        deferred.save(self.loader.state_dict(), folder / "data.pt")
        # The parameters' and the optimizer's digests from the copy, on the save's thread: the copy holds the values
        # saved, and a digest depends only on a tensor's values and global indices (FSDP2's DTensors keep their own
        # specs). Only the probe runs now: it needs the live model.
        copy = deferred.copied(layout.shard_name("model", 1, 0))
        optim_copy = deferred.copied(layout.shard_name("optim", 1, 0))
        names = [n for n, _ in certificate.named_state(self.model)]
        later = (
            self.s.fsdp_version == 2
            and copy is not None
            and sorted(copy) == sorted(names)
            and isinstance(optim_copy, dict)
            and "param_groups" in optim_copy
        )
        cert = self.certificate(step, params={} if later else None, optimizer=({}, []) if later else None)

        def before(path) -> None:
            if path.name == "data.pt":  # as in save(): a kill here leaves a half-written staging folder
                fault_point("mid_save", step)

        def write() -> None:
            deferred.write(before=before)
            if later:
                moments, steps = certificate.optimizer_digests_of_copy(self.model, self.optim, optim_copy)
                done = replace(
                    cert,
                    params=certificate.digests((n, copy[n]) for n in names),
                    optimizer=moments,
                    optimizer_steps=steps,
                )
            else:
                done = cert
            done.write(folder)

        return write

    def prepare_host_buffers(self) -> str:
        """The host buffers of saves off the critical path, allocated (and their pages touched) before the first
        step (relay.trainers.async_save.prepare)."""
        from relay.trainers.async_save import prepare

        return prepare(self.host_buffers, {"actor": self.ckpt})

    def certificate(
        self,
        step: int,
        probe_ids: list[list[int]] | None = None,
        *,
        params: dict | None = None,
        optimizer: tuple[dict, list[int]] | None = None,
    ):
        """The certificate of the state held now: the probe's log-probs in eval mode (no RNG drawn, nothing
        trained), the parameters' digests (unless given), the optimizer's moments and steps (unless given), its LR, the
        data position and the RNG states."""
        from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

        from relay.checkpoints import certificate

        torch = self.torch
        t0 = time.perf_counter()
        ids = probe_ids if probe_ids is not None else self.probe_ids
        logprobs = certificate.probe_logprobs(self.model, ids, task.VOCAB[task.PAD])
        state: dict = next(iter(self.optim.state.values()), {})
        moments, steps = optimizer if optimizer is not None else certificate.optimizer_digests(self.model, self.optim)
        return certificate.Certificate(
            step=step,
            world_size=1,
            device="cpu",
            probe_ids=ids,
            logprobs=logprobs,
            params=params if params is not None else certificate.param_digests(self.model),
            optimizer_step=int(state["step"]) if "step" in state else None,
            lr=float(self.scheduler.get_last_lr()[0]),
            data=certificate.state_digest(self.loader.state_dict()),
            rng=certificate.state_digest(BaseCheckpointManager.get_rng_state()),
            probe_seconds=round(time.perf_counter() - t0, 4),
            torch=torch.__version__,
            pad_id=task.VOCAB[task.PAD],
            optimizer=moments,
            optimizer_steps=steps,
        )

    def restore(self, folder) -> None:
        """Everything a resume needs, through Relay's safe loader (weights_only), never verl's unpickling one."""
        from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
        from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager
        from verl.utils.fsdp_utils import get_fsdp_state_ctx

        actor = folder / "actor"
        name = lambda kind: actor / layout.shard_name(kind, 1, 0)  # noqa: E731
        with get_fsdp_state_ctx(
            self.model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig()
        ):
            self.model.load_state_dict(safeload.load(name("model"), mmap=False))
            self.optim.load_state_dict(safeload.load(name("optim"), mmap=False))
        extra = safeload.load(name("extra_state"), mmap=False)
        self.scheduler.load_state_dict(extra["lr_scheduler"])
        self.loader.load_state_dict(safeload.load(folder / "data.pt", mmap=False))
        step = int(folder.name.rpartition("_")[2])
        # The epoch of the last consumed batch, not step // steps_per_epoch: a state saved right after
        # an epoch's last batch resumes that epoch's (empty) remainder first, as the uninterrupted
        # loop does. (verl's v1 trainer uses step // len(dataloader) and so loses an epoch there.)
        self.epoch = (step - 1) // self.steps_per_epoch
        # RNG last: nothing after this point may draw before the first resumed step.
        BaseCheckpointManager.load_rng_state(extra["rng"])

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
