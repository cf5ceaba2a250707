"""A worker killed on a node whose kernel OOM-kill count rose while its job ran is an OOM kill (`host_oom`), named by
its node; the same kill without that evidence stays `preempted`, whatever Ray's text lists among its "common causes".
Real Ray (the session's head), a real job whose worker is SIGKILLed, the census read by tasks pinned to each node and
by a Ray job of its own, as the train task reads it; the node's counter is a test double (RELAY_NODE_OOM_COUNTER in
the spec's ray.env_vars), nothing else."""

import textwrap
import time

import pytest

from relay.jobs.ray_jobs import RayJobs, shipped_code
from relay.runs import failure_cause, node_oom
from relay.runs.metrics import read_events
from relay.spec.run_spec import load_spec
from support.helpers import write_spec
from support.polling import wait_for

pytestmark = pytest.mark.services

# A chunk's job as a trainer inside Ray runs it: its census of every node's count (as ChunkSession records it), then a
# worker of the job is SIGKILLed (once the test says so), and the driver fails on its dead actor.
JOB = """
import os, signal, sys, time
from pathlib import Path
import ray
from relay.runs import node_oom
from relay.runs.metrics import record_event

run_dir, attempt, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
ray.init()
record_event(run_dir, node_oom.EVENT, attempt=attempt, node_oom_kills=node_oom.census_if_connected())

@ray.remote(max_restarts=0, max_task_retries=0)
class RolloutWorker:
    def generate(self):
        while not go.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

ray.get(RolloutWorker.remote().generate.remote())
"""


@pytest.mark.parametrize("counter_rose", [True, False], ids=["oom-count-rose", "no-oom-count"])
def test_a_killed_worker_is_an_oom_kill_only_with_its_nodes_evidence(tmp_path, ray_address, counter_rose):
    counter = tmp_path / "vmstat"
    counter.write_text("pgfault 1\noom_kill 5\n")
    spec = load_spec(
        write_spec(tmp_path, name="r", s3=None, **{"ray.env_vars": {node_oom.COUNTER_ENV: str(counter)}}),
        check_environment=False,
    )
    run_dir, go = tmp_path / "run", tmp_path / "go"
    run_dir.mkdir()
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    jobs = RayJobs(ray_address)
    sub = f"oom-test-{int(time.time() * 1000)}"
    jobs.client.submit_job(
        entrypoint=f"python job.py {run_dir} {sub} {go}",
        submission_id=sub,
        runtime_env={
            **shipped_code(),
            "working_dir": str(tmp_path),
            "excludes": [*shipped_code()["excludes"], "run", "*.yaml"],
            "env_vars": {node_oom.COUNTER_ENV: str(counter)},
        },
    )
    wait_for(lambda: any(e["event"] == node_oom.EVENT for e in read_events(run_dir)), 120, "the job's census")
    start = next(e for e in read_events(run_dir) if e["event"] == node_oom.EVENT)
    assert {n["oom_kill"] for n in start["node_oom_kills"].values()} == {5}, start
    if counter_rose:
        counter.write_text("pgfault 1\noom_kill 6\n")  # the node's kernel killed a process meanwhile
    go.touch()
    wait_for(lambda: (s := jobs.get(sub)) is not None and s.status in ("FAILED", "STOPPED", "SUCCEEDED"), 120, "the end")
    state, tail = jobs.get(sub), jobs.logs(sub)
    assert state.status == "FAILED", tail[-2000:]
    assert failure_cause.could_be_oom_kill(state.message, tail, state.exit_code), tail[-2000:]
    evidence = node_oom.evidence_since_start(run_dir, sub, jobs, spec)  # as the train task reads it
    cause = failure_cause.classify(state.status, state.message, tail, state.exit_code, step=3, oom_nodes=evidence)
    if counter_rose:
        assert cause.cause == failure_cause.HOST_OOM, cause.report()
        assert "OOM killer ended 1 process(es) there while the job ran (oom_kill 5 -> 6)" in cause.evidence[0]
    else:
        assert evidence == [] and cause.cause == failure_cause.PREEMPTED, cause.report()
