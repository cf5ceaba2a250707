"""Write real verl checkpoints: verl's FSDPCheckpointManager in W gloo processes on CPU (FSDP1 or FSDP2),
plus data.pt (a StatefulDataLoader state, as verl's trainer saves it) and the tracker.

    python tests/support/verl_checkpoint.py RUN_DIR --step N --world-size W --fsdp 1|2 [--hidden H --layers L]
                                            [--load-from RUN_DIR2: verl loads its step at W, then saves it]

Used by the tests (every world size and FSDP version) and by the benchmark (a checkpoint of GBs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path


def _worker(rank: int, args) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=args.world_size)
    torch.manual_seed(args.seed)
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        architectures=["Qwen2ForCausalLM"],
        tie_word_embeddings=bool(args.tied),
    )
    model = Qwen2ForCausalLM(cfg)
    mesh = init_device_mesh("cpu", (args.world_size,), mesh_dim_names=("fsdp",))
    if args.fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=mesh)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from verl.utils.fsdp_utils import get_fsdp_wrap_policy

        # As verl's FSDP1 engine wraps it: a unit per decoder layer (_no_split_modules), flat parameters
        # (fsdp_config.use_orig_params defaults to false), so the optimizer holds one state per unit.
        model = FSDP(
            model,
            device_mesh=mesh,
            auto_wrap_policy=get_fsdp_wrap_policy(model),
            use_orig_params=False,
            device_id=torch.device("cpu"),
        )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    manager = FSDPCheckpointManager(model=model, optimizer=optim, lr_scheduler=sched, checkpoint_config=None)
    step_dir = Path(args.run_dir) / f"global_step_{args.step}"
    if args.load_from:
        # verl's own load of a checkpoint at this world size (a resharded one, say), then verl's own save of
        # what it loaded: the files verl writes at this world size from those values
        manager.load_checkpoint(str(Path(args.load_from) / f"global_step_{args.step}" / "actor"))
    else:
        model(input_ids=torch.randint(0, args.vocab, (2, 4))).logits.float().mean().backward()
        optim.step()
    manager.save_checkpoint(str(step_dir / "actor"), global_step=args.step)
    if args.deferred_to:
        _deferred_save(args, rank, model, optim, manager)
    if rank == 0:
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(list(range(64)), batch_size=8)
        it = iter(loader)
        next(it)
        torch.save(loader.state_dict(), step_dir / "data.pt")
        (Path(args.run_dir) / "latest_checkpointed_iteration.txt").write_text(str(args.step))
    dist.barrier()
    dist.destroy_process_group()


def _deferred_save(args, rank: int, model, optim, manager) -> None:
    """The same step saved again into args.deferred_to as Relay saves off the critical path in verl's workers
    (relay.trainers.verl_ppo.worker_saves: defer, verl's own save, write_behind, a thread writing the copies)."""
    from types import SimpleNamespace

    from relay.trainers.verl_ppo import worker_saves

    engine = SimpleNamespace(module=model, optimizer=optim, checkpoint_manager=manager)
    worker = SimpleNamespace(actor=SimpleNamespace(engine=engine))  # verl's worker object, as certify.actor_of finds it
    actor_dir = Path(args.deferred_to) / f"global_step_{args.step}" / "actor"
    done = Path(args.deferred_to) / f".written-{rank}.json"
    worker_saves.prepare(worker)
    worker_saves.defer(worker, args.step, digest=args.fsdp == 2)
    manager.save_checkpoint(str(actor_dir), global_step=args.step)
    assert not list(actor_dir.glob(f"*_rank_{rank}.pt")), "this rank's shards are written after verl's save, not in it"
    worker_saves.write_behind(worker, str(done))
    [result] = worker_saves.wait_written([done], lambda: None)
    done.write_text(json.dumps(result))


def make(
    run_dir: Path,
    step: int = 1,
    world_size: int = 1,
    fsdp: int = 2,
    hidden: int = 32,
    layers: int = 1,
    vocab: int = 64,
    seed: int = 0,
    load_from: Path | None = None,
    tied: bool = False,
    deferred_to: Path | None = None,
) -> Path:
    """Write global_step_<step> of run_dir in a fresh interpreter (spawns `world_size` processes); another
    seed gives other weights of the same shapes (a step trained again). load_from: a run folder whose step
    verl loads at this world size (instead of training a step) before it saves. tied: the model's embeddings tied to
    its output layer. deferred_to: a run folder where the same step is saved again as Relay's saves off the critical
    path do in verl's workers (each rank's `.written-<rank>.json` says what its thread wrote)."""
    return make_many([dict(locals())])[0]


def make_many(checkpoints: list[dict]) -> list[Path]:
    """Several checkpoints (each a dict of make's arguments) written one after the other by one interpreter, which
    imports torch, transformers and verl once (about 7 CPU-s an interpreter here)."""
    jobs = [{**_DEFAULTS, **c, "run_dir": str(c["run_dir"])} for c in checkpoints]
    for j in jobs:
        for key in ("load_from", "deferred_to"):
            j[key] = str(j[key]) if j.get(key) else None
    subprocess.run([sys.executable, __file__, "--batch", json.dumps(jobs)], check=True, capture_output=True, text=True)
    return [Path(j["run_dir"]) / f"global_step_{j['step']}" for j in jobs]


_DEFAULTS = {
    "step": 1,
    "world_size": 1,
    "fsdp": 2,
    "hidden": 32,
    "layers": 1,
    "vocab": 64,
    "seed": 0,
    "tied": False,
    "load_from": None,
    "deferred_to": None,
}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("run_dir", nargs="?")
    p.add_argument("--step", type=int, default=1)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--fsdp", type=int, choices=[1, 2], default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-from")
    p.add_argument("--tied", action="store_true")
    p.add_argument("--deferred-to")
    p.add_argument("--batch", help="a JSON list of make()'s arguments: several checkpoints, one after the other")
    a = p.parse_args()
    if a.batch:
        batch = [argparse.Namespace(**j) for j in json.loads(a.batch)]
    elif a.run_dir:
        batch = [a]
    else:
        p.error("give RUN_DIR or --batch")
    # torch, transformers and verl imported once, here, and the ranks forked from this process: spawned, each
    # rank imported them again (about 8 CPU-s apiece on these cores). No process group exists before the fork.
    import torch.multiprocessing as mp
    import transformers  # noqa: F401
    import verl.utils.checkpoint.fsdp_checkpoint_manager
    import verl.utils.fsdp_utils  # noqa: F401
    from ports import free_port  # run as a script: this folder is on sys.path

    for job in batch:
        job.port = free_port()
        mp.start_processes(_worker, args=(job,), nprocs=job.world_size, start_method="fork")
