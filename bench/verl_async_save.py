"""verl's async save at world size 2: what a save off the critical path blocks in verl's workers, against a
synchronous save of the same state.

Two gloo ranks on this machine's CPUs, each a verl worker's checkpoint path as Relay runs it: verl's own
FSDPCheckpointManager over an FSDP2 Qwen2 wider than the CPU spec's tiny model (hidden 1024, 6 layers, a 32k
vocabulary with tied embeddings: about 0.1 billion parameters, whose weights and AdamW state are over 1 GiB), its
optimizer state made by one AdamW step. The synchronous save is what a worker does at a chunk's synchronous save:
verl's save_checkpoint, the certificate's digests of the parameters and the optimizer's moments, all-reduced
(relay.trainers.verl_ppo.certify), and the fsync of the rank's files. The async save's blocking part is Relay's
worker path (relay.trainers.verl_ppo.worker_saves): `defer`, verl's same save_checkpoint with its torch.save
deferred into host buffers allocated before the first step, and `write_behind` starting the rank's thread (which
writes, fsyncs and digests the copies). The certificate's probe (a forward pass on every rank) blocks both alike;
it is timed apart and a second ratio counts it in both. Each is timed in both ranks between barriers, the slower
rank counted (training waits for it); three of each alternately, medians. Every async save's files are then
written by the threads, with the certificate's digests of the copies, and compared byte for byte with the
synchronous save's.

This runs the workers' code path without the rest of a verl job (Ray, the rollout, the trainer): a 0.1 billion
parameter model's rollout on these cores would take the benchmark past its budget and time nothing of the save.
Prints `RATIO verl async save blocking / synchronous save: N.NNx`, and the same with the probe in both.

Run with ./scripts/bench.sh verl_async_save
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins"))

WORLD_SIZE = 2
REPEATS = 3
MODEL = {
    "vocab_size": 32768,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 6,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "tie_word_embeddings": True,
}


def _rank(rank: int, port: int, work: str) -> None:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    from relay.trainers.verl_ppo import certify, worker_saves

    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(architectures=["Qwen2ForCausalLM"], **MODEL))
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD_SIZE,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(input_ids=torch.randint(0, MODEL["vocab_size"], (1, 8))).logits.float().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0)
    manager = FSDPCheckpointManager(model=model, optimizer=optim, lr_scheduler=sched, checkpoint_config=None)
    engine = SimpleNamespace(
        module=model, optimizer=optim, lr_scheduler=sched, checkpoint_manager=manager, eval_mode=contextlib.nullcontext
    )
    worker = SimpleNamespace(actor=SimpleNamespace(engine=engine))  # verl's worker object, as Relay reaches it
    prepared = worker_saves.prepare(worker)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, MODEL["vocab_size"], (32,), generator=g).tolist() for _ in range(certify.PROBE_SEQUENCES)]

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # training goes on when the slower rank does
        return float(took)

    out: dict = {"sync": [], "block": [], "probe": [], "write": [], "prepared": prepared}
    for i in range(REPEATS):
        sync_dir, async_dir = Path(work, f"sync{i}", "actor"), Path(work, f"async{i}", "actor")
        done = Path(work, f"async{i}", f".written-{rank}.json")

        def sync_save(sync_dir: Path = sync_dir) -> None:
            manager.save_checkpoint(str(sync_dir), global_step=1)
            certify._engine_digests(engine)  # the certificate's digests, all-reduced, on the training thread
            for f in sync_dir.glob(f"*_rank_{rank}.pt"):
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())

        def async_blocking(async_dir: Path = async_dir, done: Path = done) -> None:
            worker_saves.defer(worker, 1, digest=True)
            manager.save_checkpoint(str(async_dir), global_step=1)
            worker_saves.write_behind(worker, str(done))  # its thread writes, fsyncs and digests the copies

        def probe() -> None:
            certify.worker_piece(worker, ids, 0, digests=False)

        out["sync"].append(timed(sync_save))
        out["block"].append(timed(async_blocking))
        out["probe"].append(timed(probe))
        t0 = time.perf_counter()
        [result] = worker_saves.wait_written([done], lambda: None)
        out["write"].append(time.perf_counter() - t0)
        if "digests" not in result:
            raise SystemExit(f"rank {rank}: no digests of the copies ({result.get('digest_error')})")
        for f in sorted(sync_dir.glob(f"*_rank_{rank}.pt")):
            if f.read_bytes() != (async_dir / f.name).read_bytes():
                raise SystemExit(f"rank {rank}: {f.name} of the async save differs from the synchronous save's")
        out["state"] = sum(f.stat().st_size for f in sync_dir.glob(f"*_rank_{rank}.pt"))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(sync_dir.parent)
            shutil.rmtree(async_dir.parent)
    Path(work, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    from relay.trainers.verl_ppo.verl_contract import CPU_PLATFORM_ENV

    os.environ.update(CPU_PLATFORM_ENV)  # verl's cpu platform, as a CPU job's workers have it
    import torch.multiprocessing as mp
    import transformers  # noqa: F401  (imported once, before the ranks fork)
    import verl.utils.checkpoint.fsdp_checkpoint_manager  # noqa: F401

    work = tempfile.mkdtemp(prefix="relay-bench-verl-async-", dir=os.environ.get("RELAY_BENCH_DIR"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_rank, args=(port, work), nprocs=WORLD_SIZE, start_method="fork")
        ranks = [json.loads(Path(work, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    from relay.trainers.verl_ppo.certify import PROBE_SEQUENCES as certify_probes

    sync, block, probe = ranks[0]["sync"], ranks[0]["block"], ranks[0]["probe"]  # the slower rank's, in every rank
    state = sum(r["state"] for r in ranks)
    written = max(statistics.median(r["write"]) for r in ranks)
    print(
        f"verl's FSDPCheckpointManager at world size {WORLD_SIZE}, FSDP2, tied embeddings: a {state / 2**30:.2f} GiB state"
    )
    print(f"rank 0: {ranks[0]['prepared']}")
    print("every async save's files: the synchronous save's bytes, in every rank")
    print(
        f"synchronous save with fsync {statistics.median(sync):.2f}s (runs {', '.join(f'{x:.2f}' for x in sync)}); "
        f"async blocking {statistics.median(block):.2f}s (runs {', '.join(f'{x:.2f}' for x in block)}); the "
        f"threads' writes, fsync and digests after it {written:.2f}s"
    )
    print(
        f"the certificate's probe (a forward of {certify_probes} sequences, in both kinds of save) "
        f"{statistics.median(probe):.2f}s (runs {', '.join(f'{x:.2f}' for x in probe)})"
    )
    sync_s, block_s, probe_s = (statistics.median(x) for x in (sync, block, probe))
    print(f"RATIO verl async save blocking / synchronous save: {block_s / sync_s:.2f}x")
    with_probe = (block_s + probe_s) / (sync_s + probe_s)
    print(f"RATIO verl async save blocking / synchronous save, the probe in both: {with_probe:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
