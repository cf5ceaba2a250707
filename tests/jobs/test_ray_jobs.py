"""Chunk jobs on the session's Ray head: Relay's code reaches a job only through runtime_env."""

import time

import pytest

from relay.common import project
from relay.jobs.ray_jobs import RayJobs, runtime_env, shipped_code, submission_id
from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from relay.trainers.contract import ENV_VAR, ChunkRequest
from support.helpers import ROOT


def wait(jobs: RayJobs, sub_id: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = jobs.get(sub_id).status
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(0.5)
    raise AssertionError(f"job {sub_id} did not end")


@pytest.mark.services
def test_relay_reaches_a_job_only_through_runtime_env(ray_address):
    jobs = RayJobs(ray_address)
    probe = (
        'python -c \'import relay, os, importlib.util as u; print("RELAY_AT", relay.__file__); '
        'print("CWD", os.getcwd()); print("LOCAL_ONLY", u.find_spec("relay.devstack"), '
        'u.find_spec("relay.airflow")); import relay.preflight.admission, relay.trainers.job\''
    )
    with_env = jobs.client.submit_job(entrypoint=probe, runtime_env=shipped_code())
    without = jobs.client.submit_job(entrypoint=probe)
    assert wait(jobs, with_env) == "SUCCEEDED"
    logs = jobs.logs(with_env)
    relay_at = next(line.split(" ", 1)[1] for line in logs.splitlines() if line.startswith("RELAY_AT"))
    cwd = next(line.split(" ", 1)[1] for line in logs.splitlines() if line.startswith("CWD"))
    assert "runtime_resources" in relay_at and str(ROOT) not in relay_at
    assert not cwd.startswith(str(ROOT)), "the Ray head must run from outside the repo"
    # The local stack and the Airflow shells stay behind; the gate and the trainers' entry point travel.
    assert "LOCAL_ONLY None None" in logs
    assert wait(jobs, without) == "FAILED"
    assert "No module named 'relay'" in jobs.logs(without)


def test_submission_ids_are_deterministic_per_run_chunk_and_try():
    a = submission_id("demo", "run.1", "manual__2026-01-01", 2, 1)
    assert a == submission_id("demo", "run.1", "manual__2026-01-01", 2, 1)
    assert a != submission_id("demo", "run.1", "manual__2026-01-01", 2, 2)
    assert a != submission_id("demo", "run.1", "manual__2026-01-02", 2, 1)
    assert a.startswith("relay-demo-run_1-") and a.endswith("-c02-t1")


def test_runtime_env_carries_the_request_and_pins_threads():
    spec = load_spec(ROOT / "include" / "runs" / "demo.yaml", check_environment=False)
    req = ChunkRequest(run=Run.of(spec, "r"), to_step=20, chunk=1, attempt="x")
    env = runtime_env(req)
    assert env["py_modules"] == [str(project.package_dir())]
    assert env["env_vars"]["OMP_NUM_THREADS"] == str(spec.threads)
    assert ChunkRequest.from_json(env["env_vars"][ENV_VAR]) == req


def test_unreachable_ray_is_a_clear_error():
    from relay.common.errors import RayJobError

    with pytest.raises(RayJobError, match=r"cannot reach the Ray Jobs API at http://127\.0\.0\.1:9"):
        _ = RayJobs("http://127.0.0.1:9").client


# A chunk that logs 50 MB: 5 steps, each after 10 MB of verbose lines (a verl run at debug level).
VERBOSE_CHUNK = r"""
import sys, time
filler = ("x" * 99 + "\n") * 1000
for step in range(1, 6):
    for _ in range(100):
        sys.stdout.write(filler)
    print(f"[relay] step {step}/5 chunk 1 eta 1s", flush=True)
    time.sleep(1)
"""


@pytest.mark.services
def test_progress_polling_reads_a_bounded_tail_of_a_50_mb_log(ray_address, monkeypatch):
    """The trigger follows a job that writes 50 MB of log lines: each poll reads at most the log's last
    TAIL_LINES lines (about 20 KB here), whatever the log's size, and every step line still reaches the
    task log."""
    import asyncio
    import logging

    from relay.airflow import triggers
    from relay.jobs.ray_jobs import TAIL_LINES, AsyncRayJobs
    from relay.ops import follow_job

    reads: list[int] = []

    class Counted(AsyncRayJobs):
        async def tail(self, sub_id, lines=TAIL_LINES):
            before = self.bytes_read
            text = await super().tail(sub_id, lines)
            reads.append(self.bytes_read - before)
            return text

    monkeypatch.setattr(follow_job, "AsyncRayJobs", Counted)
    jobs = RayJobs(ray_address)
    sub_id = jobs.client.submit_job(entrypoint=f"python -c '{VERBOSE_CHUNK}'")
    trigger = triggers.RayJobTrigger(
        address=ray_address, submission_id=sub_id, deadline=time.time() + 300, poll_seconds=0.5, stall_after_s=120
    )
    shown: list[str] = []  # what reaches the task log (the triggerer routes the trigger's logger there)

    class TaskLog(logging.Handler):
        def emit(self, record):
            shown.append(record.getMessage())

    trigger._log = logging.getLogger(f"relay.test.trigger.{sub_id}")
    trigger._log.setLevel(logging.INFO)
    trigger._log.addHandler(TaskLog())

    async def follow():
        return [e async for e in trigger.run()]

    events = asyncio.run(follow())
    assert [e.payload["status"] for e in events] == ["SUCCEEDED"]
    log_size = len(jobs.client.get_job_logs(sub_id).encode())
    assert log_size > 50_000_000
    assert reads and max(reads) <= TAIL_LINES * 100 + 4096, f"a poll read {max(reads)} bytes"
    assert sum(reads) < log_size / 20, f"{sum(reads)} bytes read in {len(reads)} polls of a {log_size}-byte log"
    steps = [line for line in shown if line.startswith("[relay] step")]
    assert steps == [f"[relay] step {s}/5 chunk 1 eta 1s" for s in range(1, 6)]


ENDING_CHUNK = """
import time
print("[relay] step 1/2 chunk 1", flush=True)
time.sleep(1)
print("[relay] step 2/2 chunk 1", flush=True)
time.sleep(2)  # the save
"""


@pytest.mark.services
def test_once_the_chunks_last_step_is_in_the_trigger_polls_for_the_jobs_end_closer(ray_address, monkeypatch):
    """The task resumes soon after the job's end: polls come every poll_seconds while the job trains, and
    every ENDING_POLL_S once the chunk's last step is in the log (its save and exit come next)."""
    import asyncio

    from relay.airflow import triggers
    from relay.ops import follow_job

    jobs = RayJobs(ray_address)
    sub_id = jobs.client.submit_job(entrypoint=f"python -c '{ENDING_CHUNK}'")
    trigger = triggers.RayJobTrigger(
        address=ray_address, submission_id=sub_id, deadline=time.time() + 300, poll_seconds=0.5, end_step=2
    )
    naps: list[tuple[float, bool]] = []  # (interval asked, whether the last step was in the log then)
    real_sleep = asyncio.sleep

    async def sleep(seconds):
        logs = jobs.client.get_job_logs(sub_id)
        naps.append((seconds, "step 2/2" in logs))
        await real_sleep(seconds)

    monkeypatch.setattr(follow_job.asyncio, "sleep", sleep)

    async def follow():
        return [e async for e in trigger.run()]

    assert [e.payload["status"] for e in asyncio.run(follow())] == ["SUCCEEDED"]
    assert {s for s, ended in naps if not ended} == {0.5}, naps
    assert naps[-1][0] == follow_job.ENDING_POLL_S and sum(1 for s, _ in naps if s == follow_job.ENDING_POLL_S) >= 4, naps


# A chunk that prints 20 MB after each step (verl at debug level) and says each step as a trainer does: its
# heartbeat in the run folder (relay.runs.heartbeat) and its step line, which the next 20 MB bury at once.
LOUD_CHUNK = r"""
import sys, time
from relay.runs import heartbeat
filler = ("x" * 99 + "\\n") * 1000
steps, run_dir, attempt = int(sys.argv[1]), sys.argv[2], sys.argv[3]
for step in range(1, 6):
    while step > steps:  # hung: no step any more, while the log goes on
        sys.stdout.write(filler)
        time.sleep(1)
    heartbeat.beat(run_dir, attempt, step)
    print(f"[relay] step {step}/5 chunk 1 eta 1s", flush=True)
    for _ in range(200):
        sys.stdout.write(filler)
    sys.stdout.flush()
    time.sleep(8)
"""


@pytest.mark.services
@pytest.mark.parametrize("steps,ends", [(5, "SUCCEEDED"), (2, "STALLED")], ids=["loud", "loud-and-hung"])
def test_a_job_that_prints_20_mb_between_steps_is_not_taken_for_stalled(ray_address, tmp_path, steps, ends):
    """The stall watch reads each attempt's heartbeat, not the log's last lines: a job printing 20 MB between its
    steps (its step lines never in a poll's tail) trains to its end; one whose steps stop is stopped within its
    limit, however much it prints."""
    import asyncio

    from relay.airflow import triggers

    script = tmp_path / "loud_chunk.py"
    script.write_text(LOUD_CHUNK)
    jobs = RayJobs(ray_address)
    env = shipped_code()
    env["working_dir"] = str(tmp_path)
    sub_id = f"loud-{steps}-{time.time_ns()}"
    jobs.client.submit_job(
        submission_id=sub_id, entrypoint=f"python loud_chunk.py {steps} {tmp_path / 'run'} {sub_id}", runtime_env=env
    )
    limit = 15.0  # steps come every ~9 s; the log's tail shows none of them
    trigger = triggers.RayJobTrigger(
        address=ray_address,
        submission_id=sub_id,
        deadline=time.time() + 600,
        poll_seconds=1,
        stall_after_s=limit,
        startup_s=5,
        end_step=5,
        run_dir=str(tmp_path / "run"),
    )

    async def follow():
        return [e async for e in trigger.run()]

    t0 = time.time()
    try:
        [event] = asyncio.run(follow())
    finally:
        jobs.client.stop_job(sub_id)
    assert event.payload["status"] == ends, event.payload
    if ends == "STALLED":
        assert event.payload["step"] == 2 and "no new step" in event.payload["message"]
        assert time.time() - t0 < 2 * 10 + limit + 15, "stopped within its limit"


def test_the_shipped_package_keeps_its_hash_while_python_writes_bytecode_beside_it(tmp_path):
    """Ray names the package by a hash of its files, then hashes them again to upload it: a .pyc that another process
    writes in between (an Airflow worker importing a module of the plugins folder for the first time) gave the job a
    package name that was never uploaded, and the job failed at once ("Failed to download runtime_env file package").
    Bytecode is not shipped, so writing it changes nothing."""
    import shutil

    from ray._private.runtime_env.packaging import get_uri_for_directory

    package = tmp_path / "relay"
    shutil.copytree(project.package_dir(), package, ignore=shutil.ignore_patterns("__pycache__"))
    excludes = shipped_code()["excludes"]
    before = get_uri_for_directory(str(package), True, excludes=excludes)
    cache = package / "checkpoints" / "__pycache__"
    cache.mkdir()
    (cache / "gate.cpython-311.pyc").write_bytes(b"\x00" * 64)
    (package / "stray.pyc").write_bytes(b"\x00" * 64)
    assert get_uri_for_directory(str(package), True, excludes=excludes) == before
    (package / "checkpoints" / "new_module.py").write_text("X = 1\n")
    assert get_uri_for_directory(str(package), True, excludes=excludes) != before, "a change of code is a new package"
