"""Chunk jobs on a Ray cluster, through the Jobs API: submit, find, stop, and follow.

Submission goes through ray's JobSubmissionClient (it packages runtime_env's py_modules and uploads
them to the cluster). Following a job from an Airflow trigger uses the same REST API with aiohttp
(AsyncRayJobs), so the triggerer never blocks its event loop and never imports ray; it reads only the
last lines of the job's log per poll (the dashboard's log API), never the whole log.

A chunk's submission id is deterministic per (spec, run, DAG run, chunk, try): a worker that runs
the same try again finds its job and re-attaches instead of starting a second one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlencode

import aiohttp

from relay.common import project
from relay.common.errors import RayJobError
from relay.spec.kinds import KINDS
from relay.trainers.contract import ENV_VAR, ChunkRequest

if TYPE_CHECKING:
    from ray.job_submission import JobSubmissionClient

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
LIVE = {"PENDING", "RUNNING"}
LOG_TAIL_LINES = 30  # the job's last log lines that a failure's message and alert carry
TAIL_LINES = 200  # what a trigger reads per poll, whatever the log's size
TAIL_MAX_BYTES = 1 << 20  # and never more bytes than this (a pathological line)
ENTRYPOINT_MODULE = "relay.trainers.job"
STOP_WAIT_ENV = "RAY_JOB_STOP_WAIT_TIME_S"
STOP_MARGIN_S = 15  # Relay waits this much longer than the grace for a stopped job to be reported ended


def submission_id(spec_name: str, run_name: str, dag_run_id: str, chunk: int, try_number: int) -> str:
    """relay-<spec>-<run>-<hash of the DAG run>-c<chunk>-t<try>: the same inputs give the same id."""
    dr = hashlib.sha256(dag_run_id.encode()).hexdigest()[:8]
    safe_run = re.sub(r"[^A-Za-z0-9_-]", "_", run_name)
    return f"relay-{spec_name}-{safe_run}-{dr}-c{chunk:02d}-t{try_number}"


def job_metadata(req: ChunkRequest, dag_run_id: str, try_number: int) -> dict[str, str]:
    return {
        "relay_spec": req.spec.name,
        "relay_run": req.run.name,
        "relay_chunk": str(req.chunk),
        "relay_try": str(try_number),
        "relay_dag_run": dag_run_id,
    }


def entrypoint(req: ChunkRequest) -> str:
    return f"{req.spec.ray.python} -m {ENTRYPOINT_MODULE}"


def job_env_vars(spec) -> dict[str, str]:
    """The spec's ray.env_vars with ${VAR} and ${VAR:-default} expanded from this process's environment.

    Expanded only here, when a job is submitted, so a secret never sits in the spec, the DAG, XCom or
    the chunk request; what the environment brings in was registered as a secret when the spec loaded
    (spec._register_secrets: redacted in alerts and reports, masked in Airflow's task logs)."""
    out = {}
    for key, value in spec.ray.env_vars.items():
        try:
            out[key] = project.expand(value)
        except KeyError as e:
            raise RayJobError(
                f"ray.env_vars.{key} names the environment variable {e.args[0]}, which is not set "
                f"where the job is submitted",
                f"set {e.args[0]} in the Airflow worker's environment (or the shell of the CLI), or "
                f"give a default as ${{{e.args[0]}:-value}}",
            ) from None
    return out


def runtime_env(req: ChunkRequest, extra_env: dict[str, str] | None = None) -> dict:
    """Relay's code travels as a py_module; nothing is installed on the cluster by hand."""

    threads = str(req.spec.threads)
    env = {
        **KINDS[req.spec.trainer.kind].job_environment(req),  # the trainer kind's own (verl_ppo: tracking ids)
        **job_env_vars(req.spec),
        ENV_VAR: req.to_json(),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "OPENBLAS_NUM_THREADS": threads,
        "PYTHONUNBUFFERED": "1",
        # `ray job stop` (Relay's own stops too) sends SIGTERM, then waits this long before its SIGKILL: the
        # trainer's time to finish its step and save it (relay.trainers.stopping). Ray reads it in the job's
        # supervisor, which runs with this environment.
        STOP_WAIT_ENV: str(req.spec.ray.stop_grace_seconds),
        **(extra_env or {}),
    }
    return {**shipped_code(), "env_vars": env}


# What stays on the machine that submits: the local stack (started by hand or by the tests) and the
# Airflow shells, which need Airflow, absent on a GPU cluster. Paths are relative to the package.
NOT_SHIPPED = ["/devstack/", "/airflow/"]


# Bytecode is not shipped either: Ray names the package by a hash of its files and hashes them again to upload it,
# so a .pyc that another process writes in between (an Airflow worker importing a plugins module for the first
# time) gave the job the name of a package that was never uploaded, and the job failed at its start.
NOT_SHIPPED_FILES = ["__pycache__", "*.pyc"]  # "__pycache__/" would not match the folder itself, whose name Ray hashes


def shipped_code() -> dict:
    """Relay's package as a py_module (Ray zips and uploads it once per content hash), less NOT_SHIPPED and bytecode."""
    return {"py_modules": [str(project.package_dir())], "excludes": [*NOT_SHIPPED, *NOT_SHIPPED_FILES]}


@dataclass
class JobState:
    submission_id: str
    status: str  # PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED
    message: str
    metadata: dict
    start_time: float | None = None  # epoch seconds
    exit_code: int | None = None  # the driver's, once it ended (negative: killed by that signal)
    end_time: float | None = None  # epoch seconds, once it ended
    job_id: str | None = None  # Ray's id of the job's driver (its placement groups' creator), once it runs


class RayJobs:
    """Synchronous side (Airflow worker, CLI): submit, look up, list and stop chunk jobs."""

    def __init__(self, address: str):
        self.address = address.rstrip("/")
        self._client: JobSubmissionClient | None = None

    @property
    def client(self):
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            _ray_logs_through_logging()

            try:
                self._client = JobSubmissionClient(self.address)
            except Exception as e:  # noqa: BLE001 - ConnectionError, or ray's own wrappers of it
                raise RayJobError(
                    f"cannot reach the Ray Jobs API at {self.address} ({e})",
                    "start the Ray head (`python -m relay stack up`) or fix the Airflow connection that names it",
                ) from None
        return self._client

    def get(self, sub_id: str) -> JobState | None:
        try:
            info = self.client.get_job_info(sub_id)
        except RuntimeError as e:
            if "does not exist" in str(e):
                return None
            raise RayJobError(f"cannot read job {sub_id} from {self.address}: {e}", "check the Ray head") from None
        return JobState(
            sub_id,
            str(info.status),
            info.message or "",
            info.metadata or {},
            _seconds(info.start_time),
            info.driver_exit_code,
            _seconds(info.end_time),
            info.job_id,
        )

    def submit(
        self, req: ChunkRequest, sub_id: str, metadata: dict[str, str], extra_env: dict[str, str] | None = None
    ) -> str:
        return self.client.submit_job(
            entrypoint=entrypoint(req),
            submission_id=sub_id,
            runtime_env=runtime_env(req, extra_env),
            metadata=metadata,
            entrypoint_num_cpus=req.spec.ray.entrypoint_num_cpus,
            entrypoint_resources=req.spec.ray.entrypoint_resources or None,
        )

    def submit_module(self, spec, module: str, env: dict[str, str], sub_id: str, metadata: dict[str, str]) -> str:
        """Run `python -m <module>` of Relay on the cluster (e.g. checkpoint validation where it lives)."""
        return self.client.submit_job(
            entrypoint=f"{spec.ray.python} -m {module}",
            submission_id=sub_id,
            metadata=metadata,
            runtime_env={**shipped_code(), "env_vars": {**job_env_vars(spec), **env, "PYTHONUNBUFFERED": "1"}},
            entrypoint_num_cpus=spec.ray.entrypoint_num_cpus,
            entrypoint_resources=spec.ray.entrypoint_resources or None,
        )

    def module_report(
        self, spec, module: str, sub_id: str, metadata: dict[str, str], marker: str, timeout_s: float
    ) -> tuple[str | None, dict | None, str]:
        """Run `python -m <module>` of Relay on the cluster (submit_module) and wait for it, at most timeout_s (then
        it is stopped): (its last status, None when it did not end in time; the JSON its log's last line starting
        with `marker` holds, None without one; its log)."""
        self.submit_module(spec, module, {}, sub_id, metadata)
        deadline = time.time() + timeout_s
        while (state := self.get(sub_id)) is None or state.status not in TERMINAL:
            if time.time() > deadline:
                self.stop(sub_id)
                return None, None, ""
            time.sleep(0.5)
        logs = self.logs(sub_id)
        marked = [line for line in logs.splitlines() if line.startswith(marker)]
        return state.status, json.loads(marked[-1][len(marker) :]) if marked else None, logs

    def live_jobs_of_run(self, spec_name: str, run_name: str) -> list[JobState]:
        out = []
        for j in self.client.list_jobs():
            md = j.metadata or {}
            if md.get("relay_spec") == spec_name and md.get("relay_run") == run_name and str(j.status) in LIVE:
                out.append(JobState(j.submission_id, str(j.status), j.message or "", md, _seconds(j.start_time)))
        return out

    def stop(self, sub_id: str) -> None:
        self.client.stop_job(sub_id)

    def stop_run(self, spec_name: str, run_name: str, *, keep: str | None = None, wait_s: float = 60) -> list[str]:
        """Stop every live job of a run (any chunk, any try) except `keep`; wait (up to wait_s: the spec's
        stop grace) until they have ended, so that one that still holds the lease can save its last step."""
        stopped = [j.submission_id for j in self.live_jobs_of_run(spec_name, run_name) if j.submission_id != keep]
        for sub_id in stopped:
            self.stop(sub_id)
        deadline = time.time() + wait_s
        while stopped and time.time() < deadline:
            if all((s := self.get(i)) is None or s.status in TERMINAL for i in stopped):
                break
            time.sleep(0.5)
        return stopped

    def logs(self, sub_id: str) -> str:
        return self.client.get_job_logs(sub_id)

    def log_tail(self, sub_id: str, lines: int = LOG_TAIL_LINES) -> str:
        """The job's last lines, for an error message or an alert, read on the driver's node (a bounded
        read, as the trigger's); '(...)' saying why when they cannot be read."""

        try:
            path = driver_log_path(sub_id, self.client.get_job_info(sub_id).driver_node_id, lines)
            with urllib.request.urlopen(f"{self.address}{path}", timeout=30) as r:
                return r.read(TAIL_MAX_BYTES).decode(errors="replace").rstrip("\n")
        except Exception as e:  # noqa: BLE001 - the failure being reported matters more
            return f"(the job's log could not be read: {e})"


def driver_log_path(sub_id: str, node_id: str, lines: int) -> str:
    """The dashboard's log API path of a job's last `lines` driver log lines, read on the driver's node."""

    return "/api/v0/logs/file?" + urlencode({"node_id": node_id, "filename": f"job-driver-{sub_id}.log", "lines": lines})


ANCHOR_LINES = 20


def new_lines(before: list[str], tail: list[str]) -> tuple[list[str], bool]:
    """The lines of `tail` (a job log's last lines now) that follow `before` (its last lines at the previous
    poll): found by the last place where before's final lines appear in tail. (lines, gap): gap is True
    when they do not appear, because more lines than a tail holds were written in between; then all of
    `tail` is new and some lines were never seen (the stall watch still sees the newest step)."""
    if not before:
        return tail, False
    anchor = before[-ANCHOR_LINES:]
    for start in range(len(tail) - len(anchor), -1, -1):
        if tail[start : start + len(anchor)] == anchor:
            return tail[start + len(anchor) :], False
    return tail, True


def _seconds(ms) -> float | None:
    """Ray's job times are epoch milliseconds."""
    return ms / 1000 if ms else None


def _ray_logs_through_logging() -> None:
    """Ray's client logs INFO lines ("Package ... already exists, skipping upload") to stderr through a
    handler of its own; Airflow labels a task's stderr ERROR. Hand them to the process's logging, at
    their own level, instead."""

    ray_log = logging.getLogger("ray")
    for handler in list(ray_log.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            ray_log.removeHandler(handler)
    ray_log.propagate = True


class AsyncRayJobs:
    """Asynchronous side (Airflow triggerer): job status, a bounded log tail and stop over the REST API."""

    def __init__(self, address: str, timeout_s: float = 10):
        self.address = address.rstrip("/")
        self.timeout_s = timeout_s
        self._driver_node: dict[str, str | None] = {}
        self.bytes_read = 0  # log bytes, for the tests' bound

    async def _request(self, method: str, path: str):
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            async with s.request(method, f"{self.address}{path}") as r:
                if r.status == 404:
                    return None
                if r.status >= 400:
                    raise RayJobError(f"Ray Jobs API {method} {path}: HTTP {r.status}: {(await r.text())[:300]}")
                return await r.json(content_type=None)

    async def get(self, sub_id: str) -> JobState | None:
        d = await self._request("GET", f"/api/jobs/{sub_id}")
        if d is None:
            return None
        self._driver_node[sub_id] = d.get("driver_node_id") or self._driver_node.get(sub_id)
        return JobState(
            sub_id,
            d.get("status", "UNKNOWN"),
            d.get("message") or "",
            d.get("metadata") or {},
            _seconds(d.get("start_time")),
            d.get("driver_exit_code"),
            _seconds(d.get("end_time")),
            d.get("job_id"),
        )

    async def tail(self, sub_id: str, lines: int = TAIL_LINES) -> str:
        """The last `lines` lines of the job's driver log, read on its node through the dashboard's log API:
        a bounded read however long the log (the Jobs API's logs endpoint returns all of it). '' before
        the driver has a node."""

        node = self._driver_node.get(sub_id)
        if not node:
            return ""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as s:
            async with s.get(f"{self.address}{driver_log_path(sub_id, node, lines)}") as r:
                if r.status >= 400:  # not written yet (the driver is starting), or rotated away
                    return ""
                data = await r.content.read(TAIL_MAX_BYTES)
        self.bytes_read += len(data)
        return data.decode(errors="replace")

    async def stop(self, sub_id: str) -> None:
        await self._request("POST", f"/api/jobs/{sub_id}/stop")
