"""A chunk as one Ray job, followed from a terminal: `relay train` of a trainer kind whose chunks only
run as Ray jobs (verl_ppo: verl's trainer drives Ray workers of its own).

The job is submitted as the DAG's train task submits one (relay.jobs.submission: `python -m
relay.trainers.job`, Relay's code in runtime_env, the request in its environment, the run's lease taken
at submission for the job's submission id, its fencing token in the request). The job's log is printed as
it comes (the Jobs API's log stream); the job's end is the command's. An interruption (Ctrl-C, or
SIGTERM/SIGHUP turned into `Interrupted` by interrupts()) stops the job before it is passed on.

Imports nothing heavy at module level (ray only inside RayJobs).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from relay.common.errors import RayJobError
from relay.jobs import submission
from relay.jobs.ray_jobs import TERMINAL, JobState, RayJobs
from relay.runs.run import Run
from relay.spec.kinds import KINDS, WorldOption
from relay.spec.plan import ChunkPlan
from relay.spec.run_spec import RunSpec
from relay.trainers.contract import ChunkRequest

STOP_WAIT_S = 30  # how long an interrupted command waits for its stopped job to end (the spec's stop grace, if given)


def runs_as_job(spec: RunSpec) -> bool:
    """Whether `relay train` runs the spec's chunks as Ray jobs (its kind's `ray_job`); else in its own process."""
    return KINDS[spec.trainer.kind].ray_job


class Interrupted(KeyboardInterrupt):
    """The command was asked to stop by a signal (SIGTERM, SIGHUP); SIGINT stays a KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interrupts(signals=(signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """SIGTERM and SIGHUP raise Interrupted in the main thread for the while (a KeyboardInterrupt, which
    no `except Exception` swallows), so that the job and the head are stopped on the way out."""

    def handler(signum, _frame):
        raise Interrupted(signum)

    saved = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def exit_code(e: KeyboardInterrupt) -> int:
    """128 + the signal's number, as a shell reports a command a signal ended."""
    return 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)


def local_submission_id(run: Run) -> str:
    """relay-<spec>-<run>-local-<host and pid hash>-<time>: a `relay train` command's job, never one of the DAG's."""
    who = hashlib.sha256(f"{socket.gethostname()}:{os.getpid()}".encode()).hexdigest()[:6]
    safe_run = re.sub(r"[^A-Za-z0-9_-]", "_", run.name)
    return f"relay-{run.spec.name}-{safe_run}-local-{who}-{int(time.time())}"


def chunk_index(spec: RunSpec, to_step: int) -> int | None:
    """The chunk of the spec's plan that to_step is in (logs, metrics rows, the job's metadata): the chunk it
    ends, or the one `relay train --to-step` stops inside (to_step 4 with chunks of 6: chunk 1, which a later
    call finishes, as a retry of it would). None for a step outside the plan."""
    plan = ChunkPlan.from_spec(spec)
    return plan.chunk_for_step(to_step).index if 1 <= to_step <= plan.total_steps else None


def metadata(req: ChunkRequest) -> dict[str, str]:
    """What the DAG's jobs carry (a train task stops a live job of its run: one writer per run), and who
    submitted it."""
    # A job that stops inside its chunk (--to-step off a boundary) carries no chunk here: a DAG's train task
    # adopts a live job of its run by (run, chunk), and this one would end before the chunk does.
    ends_chunk = req.chunk is not None and ChunkPlan.from_spec(req.spec).chunk(req.chunk).end_step == req.to_step
    return {
        "relay_spec": req.spec.name,
        "relay_run": req.run.name,
        "relay_chunk": str(req.chunk if ends_chunk else None),
        "relay_try": "0",
        "relay_dag_run": "",
        "relay_submitted_by": f"relay train ({req.attempt})",
    }


def submit_chunk(
    jobs: RayJobs,
    run: Run,
    to_step: int,
    sub_id: str,
    restore: bool = True,
    size: Callable[[], WorldOption | None] | None = None,
) -> ChunkRequest:
    """`relay train`'s job, submitted as the DAG's train task submits one (relay.jobs.submission), with this
    command's metadata; size: an elastic run's world size (relay.ops.elastic)."""
    return submission.submit_chunk(
        jobs, run, to_step, sub_id, chunk=chunk_index(run.spec, to_step), metadata=metadata, restore=restore, size=size
    ).request


class _LogStream:
    """The job's log written to `out` as it comes (the Jobs API's log stream, in a thread); `rest()` ends the stream
    and writes, once, what it has not written yet (its last lines, or all it missed when it broke off), read from
    the whole log."""

    def __init__(self, jobs: RayJobs, sub_id: str, out: TextIO):
        self.jobs, self.sub_id, self.out = jobs, sub_id, out
        _ = jobs.client  # made here, once, before the stream's thread uses it too
        self.lock = threading.Lock()
        self.written = 0  # characters of the log written so far
        self.closed = threading.Event()
        threading.Thread(target=self._stream, name=f"log-{sub_id}", daemon=True).start()

    def _stream(self) -> None:
        async def tail() -> None:  # ends with the job, or when rest() has closed it
            async for chunk in self.jobs.client.tail_job_logs(self.sub_id):
                with self.lock:
                    if self.closed.is_set():
                        return
                    self.out.write(chunk)
                    self.out.flush()
                    self.written += len(chunk)

        try:
            asyncio.run(tail())
        except Exception:  # noqa: BLE001 - a broken stream: the rest is read from the whole log
            pass

    def rest(self) -> None:
        with self.lock:  # the stream ends some seconds after the job: what it has not written yet comes from the log
            if self.closed.is_set():
                return
            self.closed.set()
            try:
                rest = self.jobs.logs(self.sub_id)[self.written :]
            except Exception:  # noqa: BLE001 - the state matters more than the last lines
                rest = ""
            if rest:
                self.out.write(rest)
                self.out.flush()


def follow(
    jobs: RayJobs, sub_id: str, out: TextIO | None = None, poll_s: float = 1.0, log: _LogStream | None = None
) -> JobState:
    """Write the job's log to `out` as it comes until the job ends; return its final state. The log's last lines
    are written before it returns (`log`: a stream the caller made, to end it itself when interrupted)."""
    log = log or _LogStream(jobs, sub_id, out or sys.stdout)
    while True:
        state = jobs.get(sub_id)
        if state is None:
            raise RayJobError(
                f"Ray job {sub_id} is no longer known at {jobs.address}",
                "the Ray head was restarted under it; run the command again (it resumes from the latest checkpoint)",
            )
        if state.status in TERMINAL:
            break
        time.sleep(poll_s)
    log.rest()
    return state


def stop(jobs: RayJobs, sub_id: str, wait_s: float = STOP_WAIT_S) -> str:
    """Stop the job and wait (bounded) for its end; its final status, or why it is not known."""
    try:
        state = jobs.get(sub_id)
        if state is None or state.status in TERMINAL:
            return state.status if state else "never submitted"
        jobs.stop(sub_id)
        deadline = time.time() + wait_s
        while time.time() < deadline:
            state = jobs.get(sub_id)
            if state is None or state.status in TERMINAL:
                return state.status if state else "gone"
            time.sleep(0.5)
        return "still stopping"
    except Exception as e:  # noqa: BLE001 - the head may be gone already
        return f"not stopped: {e}"


def failure(state: JobState) -> tuple[str, int]:
    """(what went wrong, the command's exit code) of a job that did not succeed: Ray's message without the
    log it appends (already printed), and the entrypoint's exit code (relay.trainers.job: 3 the lease was
    lost, 1 anything else), as the in-process trainer would have exited."""
    message = re.split(r",? last available logs", (state.message or "").strip().split("\n", 1)[0])[0]
    m = re.search(r"exit code (\d+)", message)
    code = int(m.group(1)) if m else 1
    return f"ended {state.status}: {message or 'no message'}", code if 1 <= code <= 125 else 1


def run_attached(
    jobs: RayJobs,
    sub_id: str,
    submit: Callable[[], object],
    *,
    watch: Callable[[str, str], None] | None = None,
    out: TextIO | None = None,
    stop_wait_s: float = STOP_WAIT_S,
) -> JobState:
    """submit() the job sub_id, follow it to its end, and stop it if this process is interrupted or fails
    meanwhile (from the submission on: a job whose submission was cut short is stopped too, if it
    exists), waiting up to stop_wait_s for it to save and end. watch(address, sub_id): names the job to a
    watchdog first (local_head.Guarded.watch_job)."""
    _ = jobs.client  # a cluster that does not answer fails here, before anything is submitted
    if watch is not None:
        watch(jobs.address, sub_id)
    log = None
    try:
        submit()
        log = _LogStream(jobs, sub_id, out or sys.stdout)
        return follow(jobs, sub_id, log=log)
    except BaseException as e:
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"failed ({e})"
        print(f"relay: {why}: stopping Ray job {sub_id} ...", file=sys.stderr, flush=True)
        stopped = stop(jobs, sub_id, stop_wait_s)
        if log is not None:  # what the job said on its way out (its graceful stop: the step it saved, its cause)
            log.rest()
        print(f"relay: Ray job {sub_id}: {stopped}", file=sys.stderr, flush=True)
        raise
