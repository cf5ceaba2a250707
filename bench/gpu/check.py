"""GPU check for one machine with one CUDA GPU: under 5 minutes. Prints one PASS/FAIL line per check; exit 0 if all pass.

1. cuda_resume: the CPU trainer's step on CUDA (tiny_grpo's policy, verl's GRPO advantage, vanilla PPO loss and KL,
   verl's cosine LR schedule, rollouts sampled with the CUDA generator) resumes bitwise. 12 steps straight, against 6
   steps, a checkpoint (model, optimizer, scheduler, and RNG through verl's BaseCheckpointManager.get_rng_state, which
   holds the CUDA generator's state only on a GPU), and 6 more steps in a fresh process that loads it with Relay's
   safe loader and restores the RNG with verl's load_rng_state. A control run that skips the CUDA RNG restore must
   differ, so the check can fail.
2. lr_chunks: verl's own LR scheduler builder (FSDPEngine._build_lr_scheduler), cosine with a 10% warmup ratio, on a
   CUDA optimizer: the LR at every step of a 3-chunk run (horizon = the run's total, scheduler state saved to disk
   and loaded by a new scheduler at each chunk, as a resumed chunk does) equals the unchunked run's, and the
   parameters end bitwise equal. The obvious trick (horizon = the chunk's end) is shown to differ.

3. verl_engine: as much of the chunked verl trainer as a machine without Ray can run. verl's own FSDP2 engine
   (FSDPEngineWithLMHead, built by EngineRegistry.new as verl's workers build it) trains the tiny model (Relay's
   `relay model tiny`, made here) with GRPO on the CPU spec's addition task: each step the rollout model is fed
   the engine's weights through get_per_tensor_param() (what verl's naive checkpoint engine hands the hf rollout)
   and samples 4 answers to each of 2 prompts with Relay's hf sampling (a generator seeded from the seed, the
   step and the sample), the partial-credit reward scores them, and the engine takes an optimizer step on the
   group-normalised policy-gradient loss. 4 steps straight, against 2 steps, the engine's save_checkpoint
   (verl's FSDPCheckpointManager), the process ended (the kill), and 2 more in a fresh process after the
   engine's load_checkpoint: rewards and weights must be bitwise equal (and differ without the load: the
   control). What does not run here: Ray, verl's
   TaskRunner, worker groups, agent and reward loops, TransferQueue (the CPU path in CI runs those).

Needs, beyond torch (a CUDA build) and transformers: verl==0.9.1 without extras (it brings hydra-core, omegaconf,
tensordict, torchdata, ray), pydantic and PyYAML (Relay's spec models), tokenizers. Relay itself comes from this
checkout (plugins/ on sys.path). Run from the repo root:

    python bench/gpu/check.py            # or: python bench/gpu/check.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS; before CUDA starts
os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins"))

STEPS, SPLIT, SEED = 12, 6, 1234
DEVICE = os.environ.get("RELAY_CHECK_DEVICE", "cuda")  # "cpu": a dry run of the script's own logic (no GPU claim)


# ------------------------------------------------------------------ 1. the CPU trainer's step on CUDA
class Policy:
    def __init__(self, device: str, horizon: int):
        import torch
        from verl.utils.torch_functional import get_cosine_schedule_with_warmup

        from relay.trainers.tiny_grpo.settings import TinyGRPOSettings
        from relay.trainers.tiny_grpo.trainer import build_model

        self.torch, self.device = torch, device
        torch.manual_seed(SEED)
        self.s = TinyGRPOSettings()
        self.model = build_model(self.s).to(device)
        self.ref = build_model(self.s).to(device).eval().requires_grad_(False)
        self.ref.load_state_dict(self.model.state_dict())
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.sched = get_cosine_schedule_with_warmup(self.optim, 2, horizon, min_lr_ratio=0.1)

    def _logprobs(self, model, seq, plen):
        logits = model(input_ids=seq).logits[:, plen - 1 : -1].float()
        return self.torch.log_softmax(logits, -1).gather(-1, seq[:, plen:].unsqueeze(-1)).squeeze(-1)

    def step(self, step: int) -> float:
        import numpy as np
        from verl.trainer.ppo.core_algos import agg_loss, compute_grpo_outcome_advantage, kl_penalty

        from relay.trainers.tiny_grpo import task

        torch, s, n = self.torch, self.s, self.s.rollout_n
        pairs = [((step * 7 + i) % 10, (step * 3 + 2 * i) % 10) for i in range(s.train_batch_size)]
        prompts = torch.tensor([task.encode_prompt(f"{a}+{b}=") for a, b in pairs], device=self.device)
        truths = [str(a + b) for a, b in pairs for _ in range(n)]
        prompts = prompts.repeat_interleave(n, 0)
        plen = prompts.shape[1]
        seq = prompts
        with torch.no_grad():  # rollout: sampled with the CUDA generator
            for _ in range(s.max_response_length):
                logits = self.model(input_ids=seq).logits[:, -1].float() / s.temperature
                seq = torch.cat([seq, torch.multinomial(torch.softmax(logits, -1), 1)], 1)
        resp = seq[:, plen:]
        eos = (resp == task.VOCAB[task.EOS]).int()
        mask = ((eos.cumsum(1) - eos) == 0).float()
        rewards = torch.tensor(
            [task.reward(task.decode_response(r.tolist()), t) for r, t in zip(resp, truths, strict=False)],
            device=self.device,
        )
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(len(rewards)), mask.sum(1).long() - 1] = rewards
        adv, _ = compute_grpo_outcome_advantage(token_rewards, mask, np.repeat(np.arange(len(pairs)), n))
        with torch.no_grad():
            old_lp, ref_lp = self._logprobs(self.model, seq, plen), self._logprobs(self.ref, seq, plen)
        lp = self._logprobs(self.model, seq, plen)
        ratio = torch.exp(lp - old_lp)
        pg = agg_loss(torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)), mask, "token-mean")
        loss = pg + s.kl_loss_coef * agg_loss(kl_penalty(lp, ref_lp, s.kl_loss_type), mask, "token-mean")
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.sched.step()
        return float(loss.item())

    def save(self, folder: Path) -> None:
        from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

        folder.mkdir(parents=True, exist_ok=True)
        torch = self.torch
        torch.save(self.model.state_dict(), folder / "model.pt")
        torch.save(self.optim.state_dict(), folder / "optim.pt")
        rng = BaseCheckpointManager.get_rng_state()
        assert DEVICE != "cuda" or "cuda" in rng, "verl saved no CUDA RNG state: is the GPU visible to this process?"
        torch.save({"lr_scheduler": self.sched.state_dict(), "rng": rng}, folder / "extra_state.pt")

    def restore(self, folder: Path, *, cuda_rng: bool = True) -> None:
        from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

        from relay.checkpoints import safeload

        self.model.load_state_dict(safeload.load(folder / "model.pt", mmap=False))
        self.optim.load_state_dict(safeload.load(folder / "optim.pt", mmap=False))
        extra = safeload.load(folder / "extra_state.pt", mmap=False)
        self.sched.load_state_dict(extra["lr_scheduler"])
        rng = dict(extra["rng"])
        if not cuda_rng:
            rng.pop("cuda", None)
        BaseCheckpointManager.load_rng_state(rng)


def run_policy(start: int, end: int, folder: Path | None, save_to: Path | None, cuda_rng: bool = True) -> dict:
    import torch

    torch.use_deterministic_algorithms(True)
    p = Policy(DEVICE, STEPS)
    if folder is not None:
        p.restore(folder, cuda_rng=cuda_rng)
    losses = [p.step(s) for s in range(start + 1, end + 1)]
    if save_to is not None:
        p.save(save_to)
    params = torch.cat([t.detach().flatten().double().cpu() for t in p.model.parameters()])
    return {"losses": losses, "params_sha": _sha(params)}


def _sha(t) -> str:
    import hashlib

    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def fresh_process(*args: str) -> dict:
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=240)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def cuda_resume() -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as d:
        ckpt = Path(d) / "global_step_6"
        straight = fresh_process("--policy", "0", str(STEPS))
        first = fresh_process("--policy", "0", str(SPLIT), "--save", str(ckpt))
        resumed = fresh_process("--policy", str(SPLIT), str(STEPS), "--load", str(ckpt))
        control = fresh_process("--policy", str(SPLIT), str(STEPS), "--load", str(ckpt), "--no-cuda-rng")
    same = first["losses"] + resumed["losses"] == straight["losses"] and resumed["params_sha"] == straight["params_sha"]
    sensitive = control["params_sha"] != straight["params_sha"]
    return same and sensitive, (
        f"12 steps straight vs 6 + resume + 6 in a new process: losses and parameters "
        f"{'bitwise equal' if same else 'DIFFER'}; without the CUDA RNG restore they "
        f"{'differ (as they must)' if sensitive else 'do NOT differ: the check cannot fail'}"
    )


# ------------------------------------------------------------------ 2. verl's LR scheduler, chunked
def lr_chunks() -> tuple[bool, str]:
    import types

    import torch
    from verl.workers.config import FSDPOptimizerConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    total, ends = 30, [10, 20, 30]

    def build(horizon: int):
        torch.manual_seed(SEED)
        param = torch.nn.Parameter(torch.randn(64, device=DEVICE))
        opt = torch.optim.AdamW([param], lr=1e-3)
        cfg = FSDPOptimizerConfig(
            lr=1e-3, lr_scheduler_type="cosine", lr_warmup_steps_ratio=0.1, min_lr_ratio=0.1, total_training_steps=horizon
        )
        sched = FSDPEngine._build_lr_scheduler(types.SimpleNamespace(optimizer_config=cfg, rank=1), opt)
        return param, opt, sched

    def train(param, opt, sched, steps):
        lrs = []
        for _ in range(steps):
            lrs.append(sched.get_last_lr()[0])
            param.grad = torch.sin(param.detach()) + 0.1
            opt.step()
            sched.step()
        return lrs

    param, opt, sched = build(total)
    straight = train(param, opt, sched, total)
    straight_sha = _sha(param.detach().double().cpu())

    def chunked(horizon_of):
        lrs, start, state = [], 0, None
        with tempfile.TemporaryDirectory() as d:
            for end in ends:
                param, opt, sched = build(horizon_of(end))
                if state:
                    param.data.copy_(torch.load(Path(d) / "p.pt", weights_only=True))
                    opt.load_state_dict(torch.load(Path(d) / "o.pt", weights_only=True))
                    sched.load_state_dict(torch.load(Path(d) / "s.pt", weights_only=True))
                lrs += train(param, opt, sched, end - start)
                torch.save(param.detach(), Path(d) / "p.pt")
                torch.save(opt.state_dict(), Path(d) / "o.pt")
                torch.save(sched.state_dict(), Path(d) / "s.pt")
                start, state = end, True
        return lrs, _sha(param.detach().double().cpu())

    lrs, sha = chunked(lambda end: total)  # Relay: the horizon stays the run's total
    naive, _ = chunked(lambda end: end)  # total_training_steps = the chunk's end
    ok = lrs == straight and sha == straight_sha and naive != straight
    first_diff = next((i + 1 for i, (a, b) in enumerate(zip(naive, straight, strict=False)) if a != b), None)
    return ok, (
        f"cosine, warmup ratio 0.1, 30 steps: 3 chunks {'==' if lrs == straight else '!='} unchunked at every "
        f"step, parameters {'bitwise equal' if sha == straight_sha else 'DIFFER'}; horizon = chunk end "
        f"differs from step {first_diff}"
    )


# ------------------------------------------------------------------ 3. verl's engine, checkpoint manager and sampling
ENGINE_STEPS, ENGINE_SPLIT, GROUP = 4, 2, 4
PROBLEMS = ((12, 7), (30, 45))


def engine_run(model_dir: str, start: int, end: int, load: str | None, save: str | None) -> dict:
    """Steps start+1..end of the engine's GRPO, in this (fresh) process; see the module's docstring."""
    import socket

    import torch
    import torch.distributed as dist

    if DEVICE == "cpu":  # verl's cpu platform (a dry run of the script's logic)
        from relay.trainers.verl_ppo.verl_contract import CPU_PLATFORM_ENV

        os.environ.update(CPU_PLATFORM_ENV)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
    import verl  # noqa: F401  (on a CPU: imports the cpu platform, VERL_USE_EXTERNAL_MODULES)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    from relay.trainers.verl_ppo.cpu import tiny_task
    from relay.trainers.verl_ppo.cpu.hf_sampling import sample, seed_of

    engine = EngineRegistry.new(
        model_type="language_model",
        backend="fsdp2",
        model_config=HFModelConfig(
            path=model_dir, use_remove_padding=False, override_config={"attn_implementation": "sdpa"}
        ),
        engine_config=FSDPEngineConfig(strategy="fsdp2"),
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=ENGINE_STEPS),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    if load:
        engine.load_checkpoint(load)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rollout = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    rollout = rollout.to(DEVICE).eval()
    rewards: list[float] = []
    for step in range(start + 1, end + 1):
        params, _ = engine.get_per_tensor_param()  # what verl's naive checkpoint engine hands the rollout
        rollout.load_state_dict({k: v.float() for k, v in params}, strict=False)
        engine.optimizer_zero_grad()
        loss = torch.zeros((), device=DEVICE)
        for i, (a, b) in enumerate(PROBLEMS):
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": tiny_task.question(a, b)}], add_generation_prompt=True, tokenize=True
            )
            prompt = list(prompt if isinstance(prompt, list) else prompt["input_ids"])  # (a BatchEncoding in 5.x)
            group = []
            for j in range(GROUP):
                tokens, _ = sample(rollout, prompt, 8, {tok.eos_token_id}, seed_of(SEED, step, f"{i}/{j}"))
                group.append((tokens, tiny_task.compute_score(tiny_task.DATA_SOURCE, tok.decode(tokens), str(a + b))))
            mean = sum(r for _, r in group) / GROUP
            for tokens, reward in group:
                ids = torch.tensor([prompt + tokens], device=DEVICE)
                logits = engine.module(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                logp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).sum()
                loss = loss - (reward - mean) * logp / (GROUP * len(PROBLEMS))
                rewards.append(reward)
        loss.backward()
        engine.optimizer_step()
        engine.lr_scheduler_step()
    if save:
        engine.save_checkpoint(save, global_step=end)
    state = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().double().cpu()
        for k, v in engine.module.state_dict().items()
    }
    dist.destroy_process_group()
    return {"rewards": rewards, "params_sha": _sha(torch.cat([state[k].flatten() for k in sorted(state)]))}


def verl_engine() -> tuple[bool, str]:
    from relay.trainers.verl_ppo.cpu.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        model = str(make_tiny_model(Path(d) / "tiny"))
        ckpt = str(Path(d) / "global_step_2" / "actor")
        straight = fresh_process("--engine", model, "0", str(ENGINE_STEPS))
        first = fresh_process("--engine", model, "0", str(ENGINE_SPLIT), "--save", ckpt)
        resumed = fresh_process("--engine", model, str(ENGINE_SPLIT), str(ENGINE_STEPS), "--load", ckpt)
        control = fresh_process("--engine", model, str(ENGINE_SPLIT), str(ENGINE_STEPS))  # no checkpoint loaded
    rewards = first["rewards"] + resumed["rewards"] == straight["rewards"]
    weights = resumed["params_sha"] == straight["params_sha"]
    moved = len(set(straight["rewards"])) > 1
    sensitive = control["params_sha"] != straight["params_sha"]
    return rewards and weights and moved and sensitive, (
        f"verl's FSDP2 engine, GRPO on the tiny model, {ENGINE_STEPS} steps straight vs {ENGINE_SPLIT} + "
        f"FSDPCheckpointManager save, a new process, load + {ENGINE_STEPS - ENGINE_SPLIT}: rewards "
        f"{'equal' if rewards else 'DIFFER'}, weights {'bitwise equal' if weights else 'DIFFER'}; rewards "
        f"{'uneven within groups' if moved else 'all equal (nothing to learn)'}; without the load the weights "
        f"{'differ (as they must)' if sensitive else 'do NOT differ: the check cannot fail'}; Ray, the TaskRunner, "
        f"worker groups and TransferQueue did not run here"
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", nargs=2, type=int)
    ap.add_argument("--engine", nargs=3)
    ap.add_argument("--save")
    ap.add_argument("--load")
    ap.add_argument("--no-cuda-rng", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.engine:  # a child process of verl_engine
        out = engine_run(a.engine[0], int(a.engine[1]), int(a.engine[2]), a.load, a.save)
        print(json.dumps(out))
        return 0
    if a.policy:  # a child process of cuda_resume
        out = run_policy(
            a.policy[0],
            a.policy[1],
            Path(a.load) if a.load else None,
            Path(a.save) if a.save else None,
            cuda_rng=not a.no_cuda_rng,
        )
        print(json.dumps(out))
        return 0
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("FAIL no CUDA device visible")
        return 1
    t0, results = time.time(), {}
    print(f"device: {torch.cuda.get_device_name(0) if DEVICE == 'cuda' else DEVICE}; torch {torch.__version__}", flush=True)
    for name, fn in (("cuda_resume", cuda_resume), ("lr_chunks", lr_chunks), ("verl_engine", verl_engine)):
        t = time.time()
        try:
            ok, detail = fn()
        except Exception as e:  # noqa: BLE001 - a check that crashes fails, with its reason
            ok, detail = False, f"{type(e).__name__}: {e}"
        results[name] = {"ok": ok, "detail": detail, "seconds": round(time.time() - t, 1)}
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail} ({time.time() - t:.0f}s)", flush=True)
    print(
        f"{sum(r['ok'] for r in results.values())} passed, {sum(not r['ok'] for r in results.values())} failed "
        f"in {time.time() - t0:.0f}s"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
