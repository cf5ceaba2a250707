"""A command's private Ray head (relay.jobs.local_head, through relay.devstack.stack.private_ray_head):
free ports, none of the local stack's; a job runs there, the CPU trainer's chunk too (the job path of
`relay train`: relay.jobs.chunk_job); SIGTERM stops the job and the head; and a SIGKILLed command
leaves no Ray process behind (its watchdog stops them).

The heads here run in child processes (the "command"), each with a job that sleeps, as `relay train`
holds its chunk's job. They never touch the session's Ray head or the local stack's: nothing here
uses `ray stop`."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relay.checkpoints.validate import latest_valid_step
from relay.devstack import stack
from relay.jobs import chunk_job, local_head
from relay.jobs.ray_jobs import RayJobs
from relay.preflight.prepare import prepare_run
from relay.runs.lease import Lease
from relay.spec.run_spec import load_spec
from support.faults import alive
from support.helpers import PY, ROOT, write_spec

GONE_WITHIN_S = 30  # a head's processes are gone this long after its command was

# The command: a private head, and a job on it followed to its end (here: one that sleeps), as
# `relay train` does it; what the test needs to know goes to INFO (a JSON file) once the job runs.
COMMAND = textwrap.dedent("""
    import json, os, shlex, sys
    from relay.devstack import stack
    from relay.jobs import chunk_job
    from relay.jobs.ray_jobs import RayJobs

    info_path, pid_path = sys.argv[1], sys.argv[2]
    driver = f"import os, time; open({pid_path!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    try:
        with chunk_job.interrupts():
            with stack.private_ray_head(num_cpus=2, say=print) as head:
                jobs = RayJobs(head.address)

                sub_id = "sleeper"

                def submit():
                    jobs.client.submit_job(entrypoint=f"python -c {shlex.quote(driver)}", submission_id=sub_id)
                    with open(info_path + ".tmp", "w") as f:
                        json.dump({"address": head.address, "folder": str(head.folder), "ports": head.ports,
                                   "job": sub_id}, f)
                    os.replace(info_path + ".tmp", info_path)

                state = chunk_job.run_attached(jobs, sub_id, submit, watch=head.watch_job)
                print("job ended", state.status, flush=True)
    except KeyboardInterrupt as e:
        print(f"interrupted: {e!r}", file=sys.stderr, flush=True)
        sys.exit(chunk_job.exit_code(e))
""")


class Command:
    """The command above in a child process, its output in a log file."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.info_path, self.pid_path, self.log = folder / "head.json", folder / "driver.pid", folder / "command.log"
        self.proc = subprocess.Popen(
            [PY, "-c", COMMAND, str(self.info_path), str(self.pid_path)],
            cwd=ROOT,
            stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 180
        while not (self.info_path.exists() and self.pid_path.exists() and self.pid_path.read_text()):
            assert self.proc.poll() is None, f"the command ended: {self.output()}"
            assert time.time() < deadline, f"no head and job within 180s: {self.output()}"
            time.sleep(0.2)
        self.info = json.loads(self.info_path.read_text())
        self.folder = Path(self.info["folder"])
        self.driver = int(self.pid_path.read_text())

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-5000:]

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        _wait_gone(self.folder, self.driver)
        local_head.stop_head(self.folder, grace_s=0)  # whatever a failed test left


def _wait_gone(folder: Path, *pids: int, timeout: float = GONE_WITHIN_S) -> list:
    """The head's processes (and pids) still alive after waiting up to timeout for them to go."""
    deadline = time.time() + timeout
    while True:
        left = [p.pid for p in local_head.head_processes(folder)] + [p for p in pids if alive(p)]
        if not left or time.time() > deadline:
            return left
        time.sleep(0.3)


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    cmd = Command(tmp_path_factory.mktemp("command"))
    yield cmd
    cmd.cleanup()


def test_a_private_head_takes_none_of_the_stacks_ports():
    stack_ports = stack.stack_ray_ports()
    assert {6390, 8265, 10001, 11000, 11999} <= stack_ports  # include/stack.env's, unless overridden
    for _ in range(20):
        ports = local_head.pick_ports(avoid=stack_ports)
        assert set(ports) == {*local_head.PORT_OPTIONS, *local_head.WORKER_PORT_OPTIONS}
        given = [ports[o] for o in local_head.PORT_OPTIONS]
        assert len(set(given)) == len(given) and not set(given) & stack_ports, ports
        assert ports["min-worker-port"] == ports["max-worker-port"] == 0  # each worker's port: the OS's pick
    cmd = local_head.head_command(["ray"], ports, num_gpus=1, temp_dir="/tmp/x")
    for option in (*local_head.PORT_OPTIONS, *local_head.WORKER_PORT_OPTIONS):
        assert f"--{option}={ports[option]}" in cmd
    assert "--temp-dir=/tmp/x" in cmd and "--num-gpus=1" in cmd


@pytest.mark.services
def test_a_trivial_job_runs_on_a_private_head_on_ports_of_its_own(command):
    ports = command.info["ports"]
    assert not {ports[o] for o in local_head.PORT_OPTIONS} & stack.stack_ray_ports()
    assert command.info["address"] != stack.ray_address()
    assert command.folder.parent == Path("/tmp") and (command.folder / local_head.SID_FILE).exists()
    jobs = RayJobs(command.info["address"])
    sub_id = jobs.client.submit_job(entrypoint='python -c "print(1)"')
    out = io.StringIO()
    state = chunk_job.follow(jobs, sub_id, out, poll_s=0.3)
    assert state.status == "SUCCEEDED", out.getvalue()
    assert "1" in out.getvalue().splitlines(), out.getvalue()
    # the head's own processes are found by their temp dir / marker, the sleeping job's driver among them
    assert command.driver in {p.pid for p in local_head.head_processes(command.folder)}


@pytest.mark.services
def test_the_cpu_trainer_runs_a_chunk_as_the_dags_job_on_it(command, tmp_path):
    spec = load_spec(write_spec(tmp_path), check_environment=True)
    run = prepare_run(spec, "r", started_by="test").run(spec)
    jobs = RayJobs(command.info["address"])
    out = io.StringIO()
    sub_id = chunk_job.local_submission_id(run)
    reqs = []
    state = chunk_job.run_attached(
        jobs, sub_id, lambda: reqs.append(chunk_job.submit_chunk(jobs, run, 2, sub_id, restore=False)), out=out
    )
    assert state.status == "SUCCEEDED", f"{state.message} (exit {state.exit_code}):\n{out.getvalue()[-3000:]}"
    assert latest_valid_step(run.dir) == 2
    assert "done: steps 0 -> 2" in out.getvalue(), out.getvalue()[-3000:]
    lease = Lease(run.dir).current()
    assert lease["holder"] == sub_id == reqs[0].attempt and lease["token"] == reqs[0].lease_token
    assert jobs.get(sub_id).metadata["relay_run"] == "r"  # as the DAG's: a train task of the run stops it


@pytest.mark.services
def test_sigterm_stops_the_job_and_the_head(command):
    command.proc.send_signal(signal.SIGTERM)
    rc = command.proc.wait(timeout=60)
    out = command.output()
    assert rc == 128 + signal.SIGTERM, out
    assert "interrupted: stopping Ray job" in out and f"Ray job {command.info['job']}: STOPPED" in out, out
    assert _wait_gone(command.folder, command.driver, timeout=5) == [], "stopped by the command itself"
    assert not command.folder.exists()
    assert not local_head._answers(f"{command.info['address']}/api/version")


@pytest.mark.services
def test_a_sigkilled_command_leaves_no_head_and_no_job(tmp_path):
    cmd = Command(tmp_path)
    try:
        assert len(local_head.head_processes(cmd.folder)) > 5
        os.kill(cmd.proc.pid, signal.SIGKILL)
        cmd.proc.wait()
        killed = time.time()
        left = _wait_gone(cmd.folder, cmd.driver)
        assert left == [], f"{left} still alive {GONE_WITHIN_S}s after the command was killed"
        print(f"head gone {time.time() - killed:.1f}s after the SIGKILL", file=sys.stderr)
        deadline = time.time() + 10
        while cmd.folder.exists() and time.time() < deadline:  # the watchdog removes it last
            time.sleep(0.2)
        assert not cmd.folder.exists()
        assert not local_head._answers(f"{cmd.info['address']}/api/version")
    finally:
        cmd.cleanup()


# ------------------------------------------------------------------ `relay train`: which path (no service)


def _verl_spec(tmp_path: Path, **settings):
    from relay.spec.run_spec import spec_from_dict

    s = {
        "model_path": str(tmp_path / "model"),
        "nnodes": 1,
        "n_gpus_per_node": 1,
        "train_batch_size": 4,
        "ppo_mini_batch_size": 2,
        "rollout_n": 2,
        **settings,
    }
    return spec_from_dict(
        {
            "name": "v",
            "trainer": {"kind": "verl_ppo", "settings": s},
            "total_steps": 4,
            "chunk_steps": 2,
            "seed": 1,
            "threads": 1,
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "data": {"train_files": [str(tmp_path / "t.parquet")]},
        },
        check_environment=False,
    )


def test_relay_train_runs_verl_ppo_as_a_ray_job_and_the_cpu_trainer_in_process(tmp_path, monkeypatch):
    import relay.cli as cli
    import relay.cli.runs as runs
    from relay.ops import train_run
    from relay.trainers.contract import ChunkResult

    taken = []
    monkeypatch.setattr(runs, "_train_as_ray_job", lambda args, run: taken.append(("job", run)) or 0)
    monkeypatch.setattr(
        train_run,
        "run_chunk",
        lambda req: taken.append(("in-process", req.run))
        or ChunkResult(req.run.name, 0, req.to_step, req.to_step, 0.0, "x"),
    )
    for spec, path in ((_verl_spec(tmp_path), "job"), (load_spec(write_spec(tmp_path)), "in-process")):
        monkeypatch.setattr(runs, "_spec", lambda *_a, _s=spec, **_k: _s)
        assert cli.main(["train", "spec.yaml", "--to-step", "2", "--offline", "--run", f"r-{path}"]) == 0
        how, run = taken.pop()
        assert how == path and run.name == f"r-{path}" and run.incarnation  # prepare_run's run, as before
    assert chunk_job.runs_as_job(_verl_spec(tmp_path)) and not chunk_job.runs_as_job(load_spec(write_spec(tmp_path)))


def test_the_cpu_platform_reaches_the_job_when_the_spec_asks(tmp_path):
    """device: cpu puts verl's cpu platform into the job's environment (the trainer kind's job_env), as the
    DAG's train task submits it; a GPU spec gets none of it."""
    from relay.jobs.ray_jobs import runtime_env
    from relay.runs.run import Run
    from relay.trainers.contract import ChunkRequest
    from relay.trainers.verl_ppo.verl_contract import CPU_PLATFORM_ENV

    def env(spec) -> dict:
        return runtime_env(ChunkRequest(run=Run.of(spec, "r"), to_step=2))["env_vars"]

    assert not CPU_PLATFORM_ENV.keys() & env(_verl_spec(tmp_path)).keys()
    cpu = _verl_spec(tmp_path, device="cpu", rollout_name="hf")
    assert CPU_PLATFORM_ENV.items() <= env(cpu).items()


def test_a_failed_jobs_exit_code_is_its_entrypoints():
    from relay.jobs.ray_jobs import JobState

    lost = JobState(
        "j",
        "FAILED",
        "Job entrypoint command failed with exit code 3, last available logs (truncated to 20,000 chars):\nboom",
        {},
    )
    assert chunk_job.failure(lost) == ("ended FAILED: Job entrypoint command failed with exit code 3", 3)
    assert chunk_job.failure(JobState("j", "STOPPED", "Job was intentionally stopped.", {}))[1] == 1


def test_a_head_that_fails_to_start_is_tried_once_more_on_other_ports_its_watchdog_kept(monkeypatch):
    import psutil

    calls = []

    def watchdogs(folder) -> list:
        return [
            p
            for p in psutil.process_iter(["cmdline"])
            if "--watch" in (p.info["cmdline"] or ()) and str(folder) in (p.info["cmdline"] or ())
        ]

    def fails(cmd, env, cwd, log, sid_file=None, timeout=0):
        calls.append(
            {
                "ports": [a for a in cmd if a.startswith("--port=")],
                "watchdog": len(watchdogs(cwd)),
                "marker": env[local_head.MARKER] == cwd.name,
                "folder": cwd,
            }
        )
        raise RuntimeError("port taken")

    monkeypatch.setattr(local_head, "run_ray_start", fails)
    with pytest.raises(local_head.HeadError, match="port taken"):
        with local_head.local_head(["ray"], {}, attempts=2):
            pass
    assert len(calls) == 2 and calls[0]["ports"] != calls[1]["ports"]
    assert [c["watchdog"] for c in calls] == [1, 1] and all(c["marker"] for c in calls)
    assert not calls[0]["folder"].exists() and not watchdogs(calls[0]["folder"])
