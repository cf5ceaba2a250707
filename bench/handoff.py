"""Warm chunks against one uninterrupted job: what a chunk boundary costs when nothing fails.

Two specs made from the demo's, 300 GRPO steps of Relay's CPU trainer in 3 chunks of 100 (about 7 s of steps per
chunk here, longer than Airflow takes to validate a chunk and admit the next), one with `chunks.handoff: warm`
and one cold, each run through its DAG on a local stack of the benchmark's own (it refuses to run beside one),
and the baseline: the same spec trained 0 -> 300 by one `relay train` process (the CPU trainer's `relay train`
runs in its own process, not as a Ray job), on the same machine with the stack up.

All three are timed the same way, from their records: from the first step's start (its metrics row's time less
its seconds) to the commit of the last checkpoint (its `checkpoint` event). The DAG runs are also timed from the
trigger to the DAG run's success, against the baseline process's start to end; the rest is Airflow's
scheduling of the last chunk's validate and publish tasks and the finish task.

Prints `RATIO warm chunks / uninterrupted job wall time: N.NNx` and the goodput ledger's start-up and handoff per
chunk of the warm run.

Then saves off the critical path (`checkpoints.async_save`), in this process: the CPU trainer with a larger model
(4 layers of width 2048: 0.2 billion parameters, whose weights and AdamW state are 2.5 GB), its optimizer state
made by one AdamW step on zero gradients. A synchronous save (verl's save code, data.pt and the certificate,
then fsync, as a chunk's save) against an async save's blocking part (the copy into host buffers allocated before,
the same save code and certificate), each taken three times alternately, medians; the async save's files are then
written and compared, byte for byte, with the synchronous save's. Prints
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
    return out


def steps_to_commit(run_dir: Path) -> float:
    """The first step's start to the last checkpoint's commit, from the run's own records."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    first = float(rows[0]["time"]) - float(rows[0]["seconds"])
    commits = [e for e in read_events(run_dir) if e.get("event") == "checkpoint" and e.get("step") == TOTAL]
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
        t0 = time.time()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "relay",
                "train",
                str(specs["cold"]),
                "--to-step",
                str(TOTAL),
                "--run",
                straight,
                "--offline",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        process_s = time.time() - t0
        if r.returncode != 0:
            print(r.stdout[-2000:], r.stderr[-2000:], file=sys.stderr)
            return 1
        straight_dir = load_spec(specs["cold"], check_environment=False).run_dir(straight)
        baseline = steps_to_commit(straight_dir)
        api = AirflowAPI(info["airflow"], info["user"], info["password"])
        measured = {}
        for handoff in ("warm", "cold"):
            spec = load_spec(specs[handoff], check_environment=False)
            api.wait_for_dag(spec.dag_id)
            run = f"bench-{handoff}-{stamp}"
            t0 = time.time()
            run_id = api.trigger(spec.dag_id, {"run": run, "alert_channels": []})["dag_run_id"]
            state = api.wait_for_run(spec.dag_id, run_id, timeout=1800)["state"]
            dag_s = time.time() - t0
            if state != "success":
                print(f"{spec.dag_id}: the DAG run ended {state}; see the Airflow UI", file=sys.stderr)
                return 1
            measured[handoff] = (steps_to_commit(spec.run_dir(run)), dag_s, spec.run_dir(run))
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
    print(f"RATIO warm chunks / uninterrupted job wall time: {measured['warm'][0] / baseline:.2f}x")
    print(
        f"RATIO cold chunks / uninterrupted job wall time, first step to last commit: {measured['cold'][0] / baseline:.2f}x"
    )
    print(
        f"RATIO trigger-to-success of the DAG run with handoff on / uninterrupted process start-to-end: "
        f"{measured['warm'][1] / process_s:.2f}x"
    )
    print(async_save_ratio())
    return 0


if __name__ == "__main__":
    sys.exit(main())
