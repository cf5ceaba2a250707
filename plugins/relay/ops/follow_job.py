"""A run's Ray job followed from outside it, without holding a worker (the front-end's triggers run these):

- `chunk_job`: a chunk's job until it ends, its new log lines (the per-step progress) said as they come, reading
  only the log's last lines per poll however long the log grows. A running job that makes no new step for longer
  than its stall limit (relay.alerts.stall) is stopped (STALLED): a hung rollout never waits out the chunk's whole
  timeout. Its steps are read from the attempt's heartbeat in the run folder (relay.runs.heartbeat), which no volume
  of log output hides, and from the log's step lines where the folder cannot be seen. The chunk's deadline is
  enforced here, stopping the job. With a warm handoff it ends (HANDED_OFF) once the job committed the chunk's end
  and went on warm into the next chunk.
- `warm_job`: a job that went on warm into the next chunk, until that chunk's train task admits it (ADMITTED), or
  something refuses the warm chunk (REFUSED, STALLED, TIMEOUT): the job then stops at its next step boundary without
  committing anything of it.
- `checkpoint`: a chunk's checkpoint waited for on storage.
- `capacity`: an elastic chunk's wait for the cluster to hold a world size again (relay.ops.elastic).

Each returns how the wait ended (`Ended`), never an exception.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from relay.alerts.stall import StallWatch
from relay.common.errors import RelayError
from relay.common.progress import STEP_LINE
from relay.jobs import cluster
from relay.jobs.ray_jobs import TERMINAL, AsyncRayJobs, new_lines
from relay.runs import handoff, heartbeat
from relay.runs.layout import checkpoint_reached

NODE_POLL_S = 10.0  # how often a running job's nodes are looked at: one of them dead ends the wait (NODE_LOST)
# Once the chunk's last step is in the log, the job's end (its save, then the driver's exit) is polled this often:
# the task resumes within this of the job's end instead of within a whole poll interval (2 s by default).
ENDING_POLL_S = 0.25
STALLED = "STALLED"  # no new step for the stall limit: the job was stopped (its warm chunk refused)
NODE_LOST = "NODE_LOST"  # a node holding the job's workers died: the job was stopped (its ranks there are gone)
HANDED_OFF = "HANDED_OFF"  # the job committed the chunk's end step and trains the next chunk (a warm handoff)
ADMITTED, REFUSED, ENDED = "ADMITTED", "REFUSED", "ENDED"  # a warm job's fate, as warm_job sees it

Say = Callable[[str], None]


@dataclass
class Ended:
    """How a wait ended: a status (a Ray job's terminal state, or one of this module's), what happened in words, and
    what else the task needs (the step a stall was seen at, the job's exit code, who refused a warm chunk)."""

    status: str
    message: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChunkWatch:
    """How a job is followed: RayJobTrigger's arguments (relay.ops.train_chunk.watch gives a chunk's), less Airflow's."""

    deadline: float  # epoch seconds: the job is stopped after this
    poll_seconds: float = 2.0
    unreachable_grace_s: float = 300.0
    stall_after_s: float | None = None  # None: no stall detection (validation jobs)
    startup_s: float = 0.0
    end_step: int | None = None  # the chunk's last step: the save after it gets startup_s too
    stop_grace_s: float = 0.0  # a job stopped here may take this long to save its step and end
    run_dir: str | None = None  # where the attempt's heartbeat is (None: the log's step lines only)
    handoff_chunk: int | None = None  # with a warm handoff: the next chunk's index


async def chunk_job(address: str, submission_id: str, w: ChunkWatch, say: Say, warn: Say) -> Ended:
    """Follow a chunk's job until it ends, stalls, runs past its deadline or hands off warm (see the module)."""
    jobs = AsyncRayJobs(address)
    watch: StallWatch | None = None  # from the job's first RUNNING poll: PENDING is waiting, not stalling
    unreachable_since: float | None = None
    seen: list[str] = []  # the log's last lines at the previous poll (a restarted triggerer starts empty)
    ending = False  # the chunk's last step is trained: its save and exit come next, polled closer
    nodes = JobNodes(address)
    while True:
        try:
            state = await jobs.get(submission_id)
            tail = (await jobs.tail(submission_id)).splitlines() if state is not None else []
            unreachable_since = None
        except Exception as e:  # noqa: BLE001 - the head is down or restarting: keep trying for a while
            now = time.time()
            unreachable_since = unreachable_since or now
            warn(f"Ray Jobs API at {address} unreachable ({e}); retrying")
            if now - unreachable_since > w.unreachable_grace_s or now > w.deadline:
                return Ended("UNREACHABLE", f"Ray Jobs API at {address} unreachable for {now - unreachable_since:.0f}s: {e}")
            await asyncio.sleep(w.poll_seconds)
            continue
        if state is None:
            return Ended(
                "LOST",
                f"job {submission_id} is unknown to the cluster at {address} (the Ray head lost it, e.g. after a restart)",
            )
        new, gap = new_lines(seen, tail)
        if gap and seen:
            say("(more lines than a poll reads were written since the last poll; the newest follow)")
        for line in new:
            say(line)
        seen = tail or seen
        beat = await asyncio.to_thread(heartbeat.last_step, w.run_dir, submission_id) if w.run_dir else None
        if w.end_step is not None and not ending:
            ending = any(int(step) >= w.end_step for step in STEP_LINE.findall("\n".join(new))) or (
                beat is not None and beat >= w.end_step
            )
        # This chunk's part is done once its end is committed and the job went on warm into the next chunk,
        # whatever befalls the job after that (a failure there is the next chunk's).
        if (ending or state.status in TERMINAL) and w.handoff_chunk is not None and w.run_dir is not None:
            if await asyncio.to_thread(handoff.went_on, w.run_dir, w.handoff_chunk, submission_id):
                return Ended(
                    HANDED_OFF,
                    f"job {submission_id} committed step {w.end_step} and went on warm into chunk {w.handoff_chunk}",
                )
        if state.status in TERMINAL:
            return Ended(state.status, state.message, {"exit_code": state.exit_code})
        if state.status == "RUNNING" and (dead := await nodes.lost(state.job_id)):
            # Its ranks there are gone: the others wait on them (a collective, a rollout) until a stall limit.
            ended = await stop_and_wait(jobs, submission_id, w.stop_grace_s, w.poll_seconds)
            names = ", ".join(f"{n.name} ({n.node_id[:12]})" for n in dead)
            return Ended(NODE_LOST, f"Ray node {names} of job {submission_id} died; job stopped ({ended})")
        if w.stall_after_s and state.status == "RUNNING":
            watch = watch or StallWatch(w.stall_after_s, w.startup_s, time.time(), w.end_step)
            watch.saw("\n".join(new), time.time())
            watch.saw_step(beat, time.time())
            if stalled := watch.stalled(time.time()):
                ended = await stop_and_wait(jobs, submission_id, w.stop_grace_s, w.poll_seconds)
                return Ended(STALLED, f"{stalled}; job {submission_id} stopped ({ended})", {"step": watch.last_step})
        if time.time() > w.deadline:
            ended = await stop_and_wait(jobs, submission_id, w.stop_grace_s, w.poll_seconds)
            return Ended("TIMEOUT", f"job {submission_id} ran past the chunk's timeout and was stopped ({ended})")
        await asyncio.sleep(min(w.poll_seconds, ENDING_POLL_S) if ending else w.poll_seconds)


class JobNodes:
    """The nodes a running job's placement groups were seen on (remembered: a dead node's bundles move), looked at
    every NODE_POLL_S; `lost` names those of them the head has declared dead."""

    def __init__(self, address: str):
        """The job's nodes on the cluster at `address`, none seen yet."""
        self.address = address
        self.seen: set[str] = set()
        self.next_look = 0.0

    async def lost(self, job_id: str | None) -> list[cluster.Node]:
        """The job's nodes the head declared dead (empty between looks, and before the job has an id)."""
        if not job_id or time.time() < self.next_look:
            return []
        self.next_look = time.time() + NODE_POLL_S
        try:
            self.seen |= await cluster.job_nodes_async(self.address, job_id)
            if not self.seen:
                return []
            return [n for n in await cluster.nodes_async(self.address) if not n.alive and n.node_id in self.seen]
        except (TimeoutError, RelayError, OSError, aiohttp.ClientError):
            return []  # the dashboard did not answer: asked again at the next look


async def stop_and_wait(jobs: AsyncRayJobs, submission_id: str, grace_s: float, poll_seconds: float) -> str:
    """Stop the job (SIGTERM: a trainer that still holds the lease finishes its step and saves it) and wait, up to
    `grace_s`, for it to end, so that the task's retry resumes from that save. What happened, in words."""
    await jobs.stop(submission_id)
    until = time.time() + grace_s
    while True:
        try:
            state = await jobs.get(submission_id)
        except Exception as e:  # noqa: BLE001 - the head went away: nothing left to wait for
            return f"its end could not be seen: {e}"
        if state is None or state.status in TERMINAL:
            return f"it ended {state.status if state else 'unknown to the cluster'}"
        if time.time() >= until:
            return f"still {state.status} after {grace_s:.0f}s"
        await asyncio.sleep(min(poll_seconds, 1.0))


async def stop(address: str, submission_id: str) -> None:
    """Stop a job (SIGTERM; Ray kills it after its stop grace)."""
    await AsyncRayJobs(address).stop(submission_id)


@dataclass
class WarmWatch:
    """How a job trained ahead is followed (relay.ops.train_chunk.ahead builds it for the ahead task)."""

    run_dir: str
    chunk: int  # the chunk trained ahead
    deadline: float  # no admission by then refuses the warm chunk (the admission limit)
    poll_seconds: float = 2.0
    stop_grace_s: float = 0.0
    stall_after_s: float | None = None  # None: no stall watch
    startup_s: float = 0.0  # more time for the first step after the handoff (the save of `from_step` first)
    from_step: int | None = None  # the committed step the job went on from


async def warm_job(
    address: str, submission_id: str, w: WarmWatch, ended_tasks: Callable[[], Awaitable[list[str]]], say: Say, warn: Say
) -> Ended:
    """Follow a job training chunk `w.chunk` ahead until that chunk's train task answers (ADMITTED, or REFUSED by
    another), the job ends (ENDED), or this refuses the warm chunk: a task of `ended_tasks` ended without going on
    (REFUSED), a stall (STALLED; waiting for the admission is not one), no admission by the deadline (TIMEOUT)."""
    jobs = AsyncRayJobs(address)
    shown: int | None = None
    # The step it went on from is its "end step": the save and handoff after it get the startup allowance.
    watch = StallWatch(w.stall_after_s, w.startup_s, time.time(), w.from_step) if w.stall_after_s else None
    while True:
        got = await asyncio.to_thread(handoff.answer, Path(w.run_dir), w.chunk, submission_id)
        if got is not None:
            if got.get("admitted"):
                return Ended(ADMITTED, f"admitted by {got.get('by')}")
            return Ended(REFUSED, str(got.get("why")), {"by": "another"})
        try:
            state = await jobs.get(submission_id)
        except Exception as e:  # noqa: BLE001 - a head restarting: the deadline still holds
            warn(f"Ray Jobs API at {address} unreachable ({e}); retrying")
            state = None
        if state is not None and state.status in TERMINAL:
            return Ended(ENDED, f"job {submission_id} ended {state.status} before its admission")
        beat, waiting = await asyncio.to_thread(heartbeat.read, w.run_dir, submission_id)
        if beat is not None and beat != shown:
            say(f"Ray job {submission_id} trains chunk {w.chunk} ahead of its admission: step {beat}")
            shown = beat
        status = why = None
        if watch is not None:
            watch.saw_step(beat, time.time())
            if waiting:
                watch.paused(time.time())
        if failed := await ended_tasks():
            status, why = REFUSED, f"its DAG run's {', '.join(failed)}"
        elif watch is not None and (stalled := watch.stalled(time.time())):
            status, why = STALLED, f"{stalled} while training ahead"
        elif time.time() > w.deadline:
            status, why = "TIMEOUT", "no admission within its admission limit"
        if status is not None:
            ended = await refuse_warm(address, submission_id, w, str(why))
            extra: dict[str, Any] = {"step": watch.last_step} if watch is not None else {}
            return Ended(status, f"{why}: its warm chunk was refused ({ended})", {"by": "this task", **extra})
        await asyncio.sleep(w.poll_seconds)


async def refuse_warm(address: str, submission_id: str, w: WarmWatch, why: str, grace_s: float | None = None) -> str:
    """Refuse the warm chunk (the job stops at its next step boundary, committing nothing of it); stop the job through
    Ray if it has not ended within w.stop_grace_s (or `grace_s`). What happened, in words."""
    refused = await asyncio.to_thread(handoff.refuse_unless_admitted, Path(w.run_dir), w.chunk, submission_id, why)
    if not refused:
        return "it was admitted already: its train task follows it"
    jobs = AsyncRayJobs(address)
    until = time.time() + (w.stop_grace_s if grace_s is None else grace_s)
    while time.time() < until:
        try:
            state = await jobs.get(submission_id)
        except Exception:  # noqa: BLE001
            state = None
        if state is None or state.status in TERMINAL:
            return f"the job ended {state.status if state else 'unknown to the cluster'}"
        await asyncio.sleep(min(w.poll_seconds, 1.0))
    await jobs.stop(submission_id)
    return "the job was still running after its grace: stopped through Ray"


async def checkpoint(run_dir: str, step: int, deadline: float, poll_seconds: float) -> Ended:
    """Wait until the run's tracker has reached `step` and global_step_<step> exists ("present"), or the deadline
    ("timeout"). A tracker that cannot be read is "present" too: it is the validator's to judge."""
    while True:
        try:
            reached = await asyncio.to_thread(checkpoint_reached, run_dir, step)
        except Exception as e:  # noqa: BLE001
            return Ended("present", str(e))
        if reached:
            return Ended("present", "")
        if time.time() > deadline:
            return Ended("timeout", f"no checkpoint for step {step} in {run_dir} before the deadline")
        await asyncio.sleep(poll_seconds)


CAPACITY, WAITED = "CAPACITY", "WAITED"  # a capacity wait's end: the cluster holds the groups, or the wait is over


async def capacity(address: str, groups: list[list[float]], until: float | None, poll_seconds: float) -> Ended:
    """Wait until the Ray cluster at `address` holds the placement groups `groups` ([CPUs, GPUs] each, on one node;
    CAPACITY) or until `until` (epoch seconds; WAITED); an elastic chunk's wait for nodes (relay.ops.elastic). A
    dashboard that does not answer is asked again at the next poll."""
    need = [(float(c), float(g)) for c, g in groups]
    while True:
        try:
            found = await cluster.nodes_async(address)
        except (TimeoutError, RelayError, OSError, aiohttp.ClientError):
            found = []
        if found and cluster.fits(need, found):
            return Ended(CAPACITY, "the cluster holds them: " + "; ".join(n.line().strip() for n in found if n.alive))
        if until is not None and time.time() >= until:
            return Ended(WAITED, "the wait for nodes is over")
        left = poll_seconds if until is None else max(0.1, min(poll_seconds, until - time.time()))
        await asyncio.sleep(left)
