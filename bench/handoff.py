"""Warm chunks against one uninterrupted job (what a chunk boundary costs when nothing fails), and saves off the
critical path against synchronous saves. On a local stack of the benchmark's own (it refuses to run beside one).

Every run is timed the same way, from its own records: from the first step's start (its metrics row's time less
its seconds) to the commit of the last checkpoint (its `checkpoint` event); the DAG runs also from the trigger
to the DAG run's success, against the baseline process's start to end (the rest is the preflight tasks, the
first chunk's start-up, and the last chunk's validation and publication).

1. verl's CPU spec (include/runs/verl_tiny_cpu.yaml: 6 steps in 3 chunks of 2). The baseline: one `relay train`
   Ray job 0 -> 6 on the stack's head. Against it, through the DAG: warm chunks (`chunks.handoff: warm`), cold
   chunks, and supervised mode. Prints `RATIO warm chunks / uninterrupted job wall time: N.NNx`.
2. Relay's CPU trainer, two specs made from the demo's: 300 steps in 3 chunks of 100 (about 5 s of steps per
   chunk), warm and cold, against one `relay train` process of the same spec (it runs in its own process, not
   as a Ray job). Plain lines: what is left of a warm run's boundary is the chunk tasks' CPU on this machine.
3. Saves off the critical path (`checkpoints.async_save`), in this process: the CPU trainer with a larger model
   (4 layers of width 2048: 0.2 billion parameters, whose weights and AdamW state are 2 GiB), its optimizer state
   made by one AdamW step on zero gradients. A synchronous save (verl's save code, data.pt and the certificate,
   then fsync, as a chunk's save) against an async save's blocking part (the copy into host buffers allocated
   before, the same save code, the certificate's probe), three of each alternately, medians; each async save's
   files are then written and compared, byte for byte, with the synchronous save's. Prints
   `RATIO async save blocking / synchronous save: N.NNx`.

Run with ./scripts/bench.sh handoff
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins"))

from relay.common.timestamps import epoch  # noqa: E402
from relay.devstack import stack  # noqa: E402
from relay.devstack.airflow_api import AirflowAPI  # noqa: E402
from relay.insights import goodput  # noqa: E402
from relay.runs.metrics import read_events, read_jsonl  # noqa: E402
from relay.spec.run_spec import load_spec  # noqa: E402

TOTAL, CHUNK = 300, 100


def write_specs(folder: Path) -> dict[str, Path]:
    base = yaml.safe_load((ROOT / "include" / "runs" / "demo.yaml").read_text())
    base["total_steps"], base["chunk_steps"] = TOTAL, CHUNK
    base["trainer"]["settings"]["total_epochs"] = 5  # 62 steps an epoch
    base["data"]["train_files"] = [str(ROOT / f) for f in base["data"]["train_files"]]
    base["data"]["val_files"] = [str(ROOT / f) for f in base["data"]["val_files"]]
    base["checkpoints"]["hf_export"] = False
    out = {}
    for handoff in ("warm", "cold"):
        spec = {**base, "name": f"bench_{handoff}", "chunks": {"handoff": handoff}}
        out[handoff] = folder / f"bench_{handoff}.yaml"
        out[handoff].write_text(yaml.safe_dump(spec, sort_keys=False))
    verl = yaml.safe_load((ROOT / "include" / "runs" / "verl_tiny_cpu.yaml").read_text())
    verl["data"]["train_files"] = [str(ROOT / f) for f in verl["data"]["train_files"]]
    verl["data"]["val_files"] = [str(ROOT / f) for f in verl["data"]["val_files"]]
    for name, mode, handoff in (
        ("warm", "chunked", "warm"),
        ("cold", "chunked", "cold"),
        ("supervised", "supervised", "cold"),
    ):
        spec = {**verl, "name": f"bench_verl_{name}", "chunks": {"handoff": handoff}}
        spec["trainer"] = {**verl["trainer"], "settings": {**verl["trainer"]["settings"], "mode": mode}}
        out[f"verl_{name}"] = folder / f"bench_verl_{name}.yaml"
        out[f"verl_{name}"].write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


def steps_to_commit(run_dir: Path, total: int = TOTAL) -> float:
    """The first step's start to the last checkpoint's commit, from the run's own records."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    first = float(rows[0]["time"]) - float(rows[0]["seconds"])
    commits = [e for e in read_events(run_dir) if e.get("event") == "checkpoint" and e.get("step") == total]
    return float(epoch(commits[-1]["time"]) or 0.0) - first


def async_save_ratio() -> str:
    import shutil
    import statistics

    from relay.common import files
    from relay.trainers.tiny_grpo import trainer as tiny

    spec_path = Path(tempfile.mkdtemp(prefix="relay-bench-async-")) / "big.yaml"
    base = yaml.safe_load((ROOT / "include" / "runs" / "demo.yaml").read_text())
    base["trainer"]["settings"]["model"] = {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    }
    base["data"]["train_files"] = [str(ROOT / f) for f in base["data"]["train_files"]]
    base["data"]["val_files"] = [str(ROOT / f) for f in base["data"]["val_files"]]
    spec_path.write_text(yaml.safe_dump(base, sort_keys=False))
    spec = load_spec(spec_path, check_environment=False)
    tiny._quiet_verl()
    trainer = tiny._TinyGRPO(spec, spec.data.train_files)
    for p in trainer.model.parameters():  # one AdamW step: the optimizer's state, as after a real step
        p.grad = p.detach().new_zeros(p.shape)
    trainer.optim.step()
    trainer.optim.zero_grad(set_to_none=True)
    said = trainer.prepare_host_buffers()
    work = spec_path.parent
    sync_s, block_s, write_s = [], [], []
    for i in range(3):
        sync_dir, async_dir = work / f"sync{i}", work / f"async{i}"
        sync_dir.mkdir()
        t0 = time.perf_counter()
        trainer.save(sync_dir, 1)
        files.fsync_tree(sync_dir)
        sync_s.append(time.perf_counter() - t0)
        async_dir.mkdir()
        t0 = time.perf_counter()
        write = trainer.snapshot(async_dir, 1)
        block_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        write()
        files.fsync_tree(async_dir)
        write_s.append(time.perf_counter() - t0)
        for f in sorted(p for p in sync_dir.rglob("*") if p.is_file() and p.name != "relay_certificate.json"):
            if f.read_bytes() != (async_dir / f.relative_to(sync_dir)).read_bytes():
                raise SystemExit(f"async save: {f.relative_to(sync_dir)} differs from the synchronous save's")
        certs = [json.loads((d / "relay_certificate.json").read_text()) for d in (sync_dir, async_dir)]
        for c in certs:
            c.pop("probe_seconds")
        if certs[0] != certs[1]:
            raise SystemExit("async save: its certificate differs from the synchronous save's")
        state = sum(p.stat().st_size for p in sync_dir.rglob("*.pt"))
        shutil.rmtree(sync_dir)
        shutil.rmtree(async_dir)
    trainer.close()
    shutil.rmtree(work, ignore_errors=True)
    sync, block, written = (statistics.median(x) for x in (sync_s, block_s, write_s))
    print(f"async save of a {state / 2**30:.2f} GiB state ({said.split(': ', 1)[1]}): the same bytes as a synchronous save")
    print(
        f"synchronous save {sync:.2f}s (runs {', '.join(f'{x:.2f}' for x in sync_s)}); async blocking {block:.2f}s "
        f"(runs {', '.join(f'{x:.2f}' for x in block_s)}), its thread's writes and fsync {written:.2f}s"
    )
    return f"RATIO async save blocking / synchronous save: {block / sync:.2f}x"


def train_straight(spec_path: Path, run: str, to_step: int, *args: str) -> tuple[float, Path] | None:
    """The baseline: `relay train` 0 -> to_step as a user runs it. (its process's seconds, the run's folder), None
    if it failed."""
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "relay", "train", str(spec_path), "--to-step", str(to_step), "--run", run, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if r.returncode != 0:
        print(r.stdout[-3000:], r.stderr[-2000:], file=sys.stderr)
        return None
    return time.time() - t0, load_spec(spec_path, check_environment=False).run_dir(run)


def run_dag(api: AirflowAPI, spec_path: Path, run: str) -> tuple[float, Path] | None:
    """Trigger the spec's DAG for `run` and wait: (trigger -> success seconds, the run's folder), None if it failed."""
    spec = load_spec(spec_path, check_environment=False)
    api.wait_for_dag(spec.dag_id)
    t0 = time.time()
    run_id = api.trigger(spec.dag_id, {"run": run, "alert_channels": []})["dag_run_id"]
    state = api.wait_for_run(spec.dag_id, run_id, timeout=1800)["state"]
    if state != "success":
        print(f"{spec.dag_id}: the DAG run ended {state}; see the Airflow UI", file=sys.stderr)
        return None
    return time.time() - t0, spec.run_dir(run)


def measure_verl(api: AirflowAPI, specs: dict[str, Path], stamp: str) -> dict | None:
    """verl's CPU spec (include/runs/verl_tiny_cpu.yaml, 6 steps in 3 chunks of 2): one `relay train` Ray job
    0 -> 6 on the stack's head (the baseline), then the DAG with warm chunks, cold chunks and supervised mode."""
    total = load_spec(specs["verl_cold"], check_environment=False).total_steps
    straight = f"bench-verl-straight-{stamp}"
    got = train_straight(specs["verl_cold"], straight, total)
    if got is None:
        return None
    process_s, straight_dir = got
    out: dict = {
        "baseline": steps_to_commit(straight_dir, total),
        "process_s": process_s,
    }
    for name in ("warm", "cold", "supervised"):
        got = run_dag(api, specs[f"verl_{name}"], f"bench-verl-{name}-{stamp}")
        if got is None:
            return None
        out[name] = (steps_to_commit(got[1], total), got[0], got[1])
    return out


def chunks_rows(run_dir: Path) -> list[list[dict]]:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return [rows[i : i + CHUNK] for i in range(0, len(rows), CHUNK)]


def main() -> int:
    if stack._http_ok(f"{stack.airflow_url()}/api/v2/monitor/health"):
        print(
            "a local stack runs: stop it first (`.venv/bin/relay stack down`); this benchmark starts its own",
            file=sys.stderr,
        )
        return 2
    runs = Path(tempfile.mkdtemp(prefix="relay-bench-handoff-"))
    specs = write_specs(runs)
    os.environ["RELAY_RUNS_DIR"] = str(runs)
    stamp = time.strftime("%Y%m%d-%H%M%S")

    info = stack.up(with_airflow=True)
    try:
        # The baseline on the same machine with the same stack up and idle: one process 0 -> TOTAL.
        straight = f"bench-straight-{stamp}"
        got = train_straight(specs["cold"], straight, TOTAL, "--offline")
        if got is None:
            return 1
        process_s, straight_dir = got
        baseline = steps_to_commit(straight_dir)
        api = AirflowAPI(info["airflow"], info["user"], info["password"])
        measured = {}
        for handoff in ("warm", "cold"):
            got = run_dag(api, specs[handoff], f"bench-{handoff}-{stamp}")
            if got is None:
                return 1
            measured[handoff] = (steps_to_commit(got[1]), got[0], got[1])
        verl = measure_verl(api, specs, stamp)
        if verl is None:
            return 1
    finally:
        stack.down(wait_s=120)

    print(f"{TOTAL} steps in chunks of {CHUNK}, Relay's CPU trainer (demo spec), this machine")
    print(f"baseline: one `relay train` process: first step -> last commit {baseline:.2f}s; process {process_s:.2f}s")
    for handoff, (s, dag_s, _) in measured.items():
        print(
            f"{handoff} chunks through the DAG: first step -> last commit {s:.2f}s; trigger -> DAG run success {dag_s:.2f}s"
        )
    ledger = goodput.ledger(measured["warm"][2])
    assert ledger is not None
    for a in ledger.attempts:
        print(
            f"  warm run, chunk {a.chunk}: started {'warm' if a.warm else 'in a new job'}; startup "
            f"{a.parts.get('startup', 0):.2f}s, handoff {a.parts.get('handoff', 0):.2f}s"
        )
    per_chunk = lambda d: [round(sum(r["seconds"] for r in chunk), 2) for chunk in chunks_rows(d)]  # noqa: E731
    print(
        f"the steps' own time per chunk: uninterrupted {per_chunk(straight_dir)}s, warm {per_chunk(measured['warm'][2])}s "
        "(the chunk tasks beside the trainer on this machine's cores: validation, publication, the next chunk's checks)"
    )
    own = sum(r["seconds"] for r in read_jsonl(measured["warm"][2] / "metrics.jsonl"))
    print(
        f"the warm run's first step -> last commit over its own steps' time: {measured['warm'][0] / own:.2f} "
        "(what its chunk boundaries add, beside the steps the tasks slowed)"
    )
    print(f"CPU trainer: warm chunks / one process, first step to last commit: {measured['warm'][0] / baseline:.2f}x")
    print(f"CPU trainer: cold chunks / one process, first step to last commit: {measured['cold'][0] / baseline:.2f}x")
    print(
        f"CPU trainer: trigger to DAG run success (warm) / one process start to end: {measured['warm'][1] / process_s:.2f}x"
    )

    b = verl["baseline"]
    print("\nverl's CPU spec, 6 steps in 3 chunks of 2; baseline: one `relay train` Ray job 0 -> 6 on the same head:")
    print(f"  first step -> last commit {b:.2f}s; the job's process {verl['process_s']:.2f}s")
    for name in ("warm", "cold", "supervised"):
        s_, dag_s, run_dir = verl[name]
        print(f"  {name}: first step -> last commit {s_:.2f}s; trigger -> DAG run success {dag_s:.2f}s")
        g = goodput.ledger(run_dir)
        if g is not None:
            print(
                "    "
                + "; ".join(
                    f"chunk {a.chunk} {'warm' if a.warm else 'new job'}: startup {a.parts.get('startup', 0):.1f}s"
                    for a in g.attempts
                )
            )
    print(f"RATIO warm chunks / uninterrupted job wall time: {verl['warm'][0] / b:.2f}x")
    print(f"RATIO cold chunks (verl) / uninterrupted job, first step to last commit: {verl['cold'][0] / b:.2f}x")
    print(f"RATIO supervised mode (verl) / uninterrupted job, first step to last commit: {verl['supervised'][0] / b:.2f}x")
    print(
        f"RATIO trigger-to-success of the verl DAG run with handoff on / uninterrupted job's process: "
        f"{verl['warm'][1] / verl['process_s']:.2f}x"
    )
    print(async_save_ratio())
    return 0


if __name__ == "__main__":
    sys.exit(main())
