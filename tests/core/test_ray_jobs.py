"""Chunk jobs on the session's Ray head: Relay's code reaches a job only through runtime_env."""

import time

import pytest

from conftest import ROOT
from relay import project
from relay.ray_jobs import RayJobs, runtime_env, submission_id
from relay.spec import load_spec
from relay.trainers.contract import ENV_VAR, ChunkRequest


def wait(jobs: RayJobs, sub_id: str, timeout: float = 120) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        status = jobs.get(sub_id).status
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(0.5)
    raise AssertionError(f"job {sub_id} did not end")


def test_relay_reaches_a_job_only_through_runtime_env(ray_address):
    jobs = RayJobs(ray_address)
    probe = "python -c 'import relay, os; print(\"RELAY_AT\", relay.__file__); print(\"CWD\", os.getcwd())'"
    with_env = jobs.client.submit_job(entrypoint=probe, runtime_env={"py_modules": [str(project.package_dir())]})
    without = jobs.client.submit_job(entrypoint=probe)
    assert wait(jobs, with_env) == "SUCCEEDED"
    logs = jobs.logs(with_env)
    relay_at = next(line.split(" ", 1)[1] for line in logs.splitlines() if line.startswith("RELAY_AT"))
    cwd = next(line.split(" ", 1)[1] for line in logs.splitlines() if line.startswith("CWD"))
    assert "runtime_resources" in relay_at and str(ROOT) not in relay_at
    assert not cwd.startswith(str(ROOT)), "the Ray head must run from outside the repo"
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
    req = ChunkRequest(spec=spec, run_name="r", to_step=20, chunk=1, attempt="x")
    env = runtime_env(req)
    assert env["py_modules"] == [str(project.package_dir())]
    assert env["env_vars"]["OMP_NUM_THREADS"] == str(spec.threads)
    assert ChunkRequest.from_json(env["env_vars"][ENV_VAR]) == req


def test_unreachable_ray_is_a_clear_error():
    from relay.errors import RayJobError

    with pytest.raises(RayJobError, match="cannot reach the Ray Jobs API at http://127.0.0.1:9"):
        RayJobs("http://127.0.0.1:9").client
