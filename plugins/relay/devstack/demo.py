"""The local demo: start the stack, trigger the demo spec's DAG like the UI does, with a crash drill that
kills chunk 2's trainer once mid-chunk to show the resume, wait for the run, and say where everything
is and which chunks started warm (chunks.handoff). It exits non-zero when the run fails or no retry resumed
chunk 2 from its start step."""

from __future__ import annotations

import time
from typing import Any

from relay.common.project import root
from relay.devstack import stack
from relay.devstack.airflow_api import AirflowAPI
from relay.insights import report
from relay.runs.metrics import SUPERSEDED, read_events, read_jsonl
from relay.runs.run import Run
from relay.spec.plan import ChunkPlan
from relay.spec.run_spec import RunSpec, load_spec

DEMO_SPEC = "include/runs/demo.yaml"


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def run(keep_running: bool = False, provoke_resume: bool = True, timeout_s: float = 1200) -> int:
    spec = load_spec(root() / DEMO_SPEC)
    demo_run = Run.of(spec, f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    fault, kill_at = drill(spec)
    say("starting the local stack: S3 (SeaweedFS), Ray head, Airflow (api-server, scheduler, dag-processor, triggerer)")
    info = stack.up(with_airflow=True)
    try:
        say(f"Airflow UI: {info['airflow']}  (user {info['user']}, password {info['password']})")
        say(f"Ray dashboard: {info['ray']}")
        api = AirflowAPI(info["airflow"], info["user"], info["password"])
        api.wait_for_dag(spec.dag_id)
        conf: dict[str, Any] = {"run": demo_run.name}
        if provoke_resume:
            conf["relay_fault"] = fault
            say(drill_notice(spec, kill_at))
        dag_run = api.trigger(spec.dag_id, conf)
        say(f"triggered {spec.dag_id}, DAG run {dag_run['dag_run_id']}, training run {demo_run}")
        state = _follow(api, demo_run, dag_run["dag_run_id"], timeout_s)
        for line in summary(demo_run, state, stack.s3_endpoint()):
            say(line)
        if state != "success":
            return 1
        if provoke_resume:
            resumed, told = resumed_chunk_2(demo_run, kill_at)
            say(told)
            return 0 if resumed else 1
        return 0
    finally:
        if keep_running:
            say("the stack keeps running; stop it with `.venv/bin/relay stack down`")
        else:
            say("stopping the local stack (after the DAG runs that the run's publications triggered)")
            stack.down(wait_s=180, say=say)


def _follow(api: AirflowAPI, run: Run, dag_run_id: str, timeout_s: float) -> str:
    spec, run_dir = run.spec, run.dir
    shown = 0
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        rows = read_jsonl(run_dir / "metrics.jsonl")
        step = max((r["step"] for r in rows), default=0)
        if step >= shown + 10 or (step and not shown):
            r = rows[-1]
            say(f"step {step}/{spec.total_steps}  reward_mean={r['reward_mean']:.3f}  loss={r['loss']:.4f}")
            shown = step
        state = api.dag_run(spec.dag_id, dag_run_id)["state"]
        if state in ("success", "failed"):
            return state
        time.sleep(1)
    return "timed out"


def drill(spec: RunSpec) -> tuple[dict[str, str], int]:
    """The demo's crash drill (the DAG run's conf relay_fault) and the step it kills at: chunk 2's trainer SIGKILLs
    itself right after the middle step of chunk 2, on its first attempt only, before it saves (a graceful stop would
    save first); Airflow's retry resumes it."""
    kill_at = spec.chunk_steps + spec.chunk_steps // 2
    return {"kill_at": f"after_step@{kill_at}"}, kill_at


def drill_notice(spec: RunSpec, kill_at: int) -> str:
    """What the demo says of its drill before it triggers the run."""
    return (
        f"chunk 2's trainer will be killed after step {kill_at} on purpose (conf relay_fault): a new job "
        f"resumes it from its latest checkpoint, step {spec.chunk_steps}"
    )


def resumed_chunk_2(run: Run, kill_at: int) -> tuple[bool, str]:
    """Whether a retry of chunk 2 resumed from its start step, and what the demo says of it (what it cost)."""
    spec, run_dir = run.spec, run.dir
    starts = [e for e in read_events(run_dir) if e["event"] == "chunk_start" and e.get("chunk") == 2]
    resumed = [e for e in starts[1:] if e.get("resumed_from") == spec.chunk_steps]
    if not resumed:
        return False, (
            f"FAILED: no retry of chunk 2 resumed from step {spec.chunk_steps} (chunk 2's attempts resumed from "
            f"{[e.get('resumed_from') for e in starts]}); the provoked resume did not happen"
        )
    lost = len(read_jsonl(run_dir / SUPERSEDED))
    return True, (
        f"chunk 2's trainer was killed after step {kill_at}; its retry resumed from step {spec.chunk_steps}: "
        f"{lost} step(s) lost and trained again (kept in {SUPERSEDED})"
    )


def summary(run: Run, state: str, s3_endpoint: str) -> list[str]:
    """What the demo says once the DAG run ended: the reward's rise, each chunk attempt and how it started, the
    publications, where the run's files are, and the run report's summary."""
    spec, run_dir = run.spec, run.dir
    rows = read_jsonl(run_dir / "metrics.jsonl")
    out = [f"DAG run finished: {state}"]
    if rows:
        first = sum(r["reward_mean"] for r in rows[:10]) / min(10, len(rows))
        last = sum(r["reward_mean"] for r in rows[-10:]) / min(10, len(rows))
        out.append(f"reward_mean: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
    for e in read_events(run_dir):
        if e["event"] == "chunk_start":
            how = (
                "started warm in the job of the chunk before (no start-up)"
                if e.get("warm")
                else "a new job, resumed"
                if e["resumed_from"]
                else "a new job, started"
            )
            out.append(f"chunk {e['chunk']} attempt {e['attempt']}: {how} from step {e['resumed_from']}")
    for e in read_events(run_dir):
        if e["event"] == "publish":
            out.append(
                f"published step {e['step']}: {e['uri']}"
                + (f"  (Hugging Face model: {e['hf_uri']})" if e.get("hf_uri") else "")
            )
    out.append(f"checkpoints: {run_dir}  (tracker: {run_dir / 'latest_checkpointed_iteration.txt'})")
    out.append(f"metrics:     {run_dir / 'metrics.jsonl'}  (one row per step)")
    out.append(f"events:      {run_dir / 'events.jsonl'}")
    if spec.s3:
        out.append(
            f"S3:          {spec.s3.uri}/{run}/latest.json on {s3_endpoint}  "
            f"(`.venv/bin/relay checkpoint ls {spec.s3.uri} --run {run}` with AWS_ENDPOINT_URL set)"
        )
    if rows:
        rep = report.build(run_dir, plan=ChunkPlan.from_spec(spec), spec=spec)
        paths = report.write(rep, report.default_out(run_dir))
        out += rep.summary().splitlines()
        out.append(f"report:      {paths['html']}  (plot: {paths['png']}; `.venv/bin/relay report {run_dir}`)")
    return out
