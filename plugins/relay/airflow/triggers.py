"""Triggers: a Ray job followed from the triggerer (RayJobTrigger), and a checkpoint waited for on
storage (CheckpointTrigger), so no worker slot is held while waiting.

RayJobTrigger streams the job's new log lines (a chunk's per-step progress) into the task log, reading
only the log's last lines per poll however long the log grows, and fires one event when the job ends.
A running job that makes no new step for longer than its stall limit (relay.alerts.stall) is
stopped, and the event says STALLED: a hung rollout never waits out the chunk's whole timeout. Its steps
are read from the attempt's heartbeat in the run folder (relay.runs.heartbeat), which no volume of log
output hides, and from the step lines of the log where the folder cannot be seen from the triggerer. It
enforces the chunk's deadline itself, stopping the job: Airflow's own defer timeout kills the
trigger without calling on_kill. A person's mark-failed or mark-success calls on_kill,
which stops the job; a clear calls it too, and then a chunk's job is left for the task's next try to
adopt; a triggerer restart does neither, and the new triggerer re-attaches.
Failures come back as events with a message, never as exceptions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from asgiref.sync import sync_to_async

from relay.alerts.stall import StallWatch
from relay.common.progress import STEP_LINE
from relay.jobs.ray_jobs import TERMINAL, AsyncRayJobs, new_lines
from relay.runs import handoff, heartbeat
from relay.runs.layout import checkpoint_reached

# Once the chunk's last step is in the log, the job's end (its save, then the driver's exit) is polled this often:
# the task resumes within this of the job's end instead of within a whole poll interval (2 s by default).
ENDING_POLL_S = 0.25
STALLED = "STALLED"  # no new step for the stall limit: the job was stopped (its warm chunk refused)
HANDED_OFF = "HANDED_OFF"  # the job committed the chunk's end step and trains the next chunk (a warm handoff)
FINAL_STATES = ("failed", "success", "skipped", "upstream_failed", "removed")  # a person's mark ends the task


class RayJobTrigger(BaseTrigger):
    def __init__(
        self,
        address: str,
        submission_id: str,
        deadline: float,
        poll_seconds: float = 2.0,
        unreachable_grace_s: float = 300.0,
        stall_after_s: float | None = None,
        startup_s: float = 0.0,
        end_step: int | None = None,
        adoptable: bool = False,
        stop_grace_s: float = 0.0,
        run_dir: str | None = None,
        handoff_chunk: int | None = None,
    ):
        super().__init__()
        self.address = address
        self.submission_id = submission_id
        self.deadline = deadline  # epoch seconds: the job is stopped after this
        self.poll_seconds = poll_seconds
        self.unreachable_grace_s = unreachable_grace_s
        self.stall_after_s = stall_after_s  # None: no stall detection (validation jobs)
        self.startup_s = startup_s
        self.end_step = end_step  # the chunk's last step: the save after it gets startup_s too
        self.adoptable = adoptable  # a cleared task's next try may adopt the job (a chunk's): leave it running
        self.stop_grace_s = stop_grace_s  # a job this trigger stops may take this long to save its step and end
        self.run_dir = run_dir  # where the attempt's heartbeat is (None: the log's step lines only)
        # With a warm handoff: the next chunk's index. The task's part ends (HANDED_OFF) once the job committed this
        # chunk's end and went on warm into that chunk (relay.runs.handoff), without waiting for the job's end.
        self.handoff_chunk = handoff_chunk

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "address": self.address,
                "submission_id": self.submission_id,
                "deadline": self.deadline,
                "poll_seconds": self.poll_seconds,
                "unreachable_grace_s": self.unreachable_grace_s,
                "stall_after_s": self.stall_after_s,
                "startup_s": self.startup_s,
                "end_step": self.end_step,
                "adoptable": self.adoptable,
                "stop_grace_s": self.stop_grace_s,
                "run_dir": self.run_dir,
                "handoff_chunk": self.handoff_chunk,
            },
        )

    def _event(self, status: str, message: str, **extra: Any) -> TriggerEvent:
        """What the task resumes with: small, since Airflow logs it whole ("Trigger fired event"); the
        task reads the job's last log lines itself when it needs them (RayJobs.log_tail)."""
        return TriggerEvent({"status": status, "submission_id": self.submission_id, "message": message, **extra})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        jobs = AsyncRayJobs(self.address)
        watch: StallWatch | None = None  # from the job's first RUNNING poll: PENDING is waiting, not stalling
        unreachable_since: float | None = None
        seen: list[str] = []  # the log's last lines at the previous poll (a restarted triggerer starts empty)
        ending = False  # the chunk's last step is trained: its save and exit come next, polled closer
        while True:
            try:
                state = await jobs.get(self.submission_id)
                tail = (await jobs.tail(self.submission_id)).splitlines() if state is not None else []
                unreachable_since = None
            except Exception as e:  # noqa: BLE001 - the head is down or restarting: keep trying for a while
                now = time.time()
                unreachable_since = unreachable_since or now
                self.log.warning("Ray Jobs API at %s unreachable (%s); retrying", self.address, e)
                if now - unreachable_since > self.unreachable_grace_s or now > self.deadline:
                    yield self._event(
                        "UNREACHABLE", f"Ray Jobs API at {self.address} unreachable for {now - unreachable_since:.0f}s: {e}"
                    )
                    return
                await asyncio.sleep(self.poll_seconds)
                continue
            if state is None:
                yield self._event(
                    "LOST",
                    f"job {self.submission_id} is unknown to the cluster at {self.address} "
                    "(the Ray head lost it, e.g. after a restart)",
                )
                return
            new, gap = new_lines(seen, tail)
            if gap and seen:
                self.log.info("(more lines than a poll reads were written since the last poll; the newest follow)")
            for line in new:
                self.log.info("%s", line)
            seen = tail or seen
            beat = await asyncio.to_thread(heartbeat.last_step, self.run_dir, self.submission_id) if self.run_dir else None
            if self.end_step is not None and not ending:
                ending = any(int(step) >= self.end_step for step in STEP_LINE.findall("\n".join(new))) or (
                    beat is not None and beat >= self.end_step
                )
            # This chunk's part is done once its end is committed and the job went on warm into the next chunk,
            # whatever befalls the job after that (a failure there is the next chunk's).
            if (ending or state.status in TERMINAL) and self.handoff_chunk is not None and self.run_dir is not None:
                if await asyncio.to_thread(handoff.went_on, self.run_dir, self.handoff_chunk, self.submission_id):
                    yield self._event(
                        HANDED_OFF,
                        f"job {self.submission_id} committed step {self.end_step} and went on warm into chunk "
                        f"{self.handoff_chunk}",
                    )
                    return
            if state.status in TERMINAL:
                yield self._event(state.status, state.message, exit_code=state.exit_code)
                return
            if self.stall_after_s and state.status == "RUNNING":
                watch = watch or StallWatch(self.stall_after_s, self.startup_s, time.time(), self.end_step)
                watch.saw("\n".join(new), time.time())
                watch.saw_step(beat, time.time())
                if stalled := watch.stalled(time.time()):
                    ended = await self._stop_and_wait(jobs)
                    yield self._event(
                        STALLED, f"{stalled}; job {self.submission_id} stopped ({ended})", step=watch.last_step
                    )
                    return
            if time.time() > self.deadline:
                ended = await self._stop_and_wait(jobs)
                yield self._event(
                    "TIMEOUT", f"job {self.submission_id} ran past the chunk's timeout and was stopped ({ended})"
                )
                return
            await asyncio.sleep(min(self.poll_seconds, ENDING_POLL_S) if ending else self.poll_seconds)

    async def _stop_and_wait(self, jobs: AsyncRayJobs) -> str:
        """Stop the job (SIGTERM: a trainer that still holds the lease finishes its step and saves it) and wait,
        up to stop_grace_s, for it to end, so that the task's retry resumes from that save. What happened, in
        words."""
        await jobs.stop(self.submission_id)
        until = time.time() + self.stop_grace_s
        while True:
            try:
                state = await jobs.get(self.submission_id)
            except Exception as e:  # noqa: BLE001 - the head went away: nothing left to wait for
                return f"its end could not be seen: {e}"
            if state is None or state.status in TERMINAL:
                return f"it ended {state.status if state else 'unknown to the cluster'}"
            if time.time() >= until:
                return f"still {state.status} after {self.stop_grace_s:.0f}s"
            await asyncio.sleep(min(self.poll_seconds, 1.0))

    async def on_kill(self) -> None:
        """A person acted on the deferred task. Marked failed or success: stop the job. Cleared (a chunk's
        train task): leave it running, since the task's next try adopts it when it still trains well
        (RayChunkOperator) and stops it otherwise; stopping it here would throw away the steps since its
        last checkpoint."""
        state = await _own_state(self)
        if self.adoptable and state not in (*FINAL_STATES, "unknown"):
            self.log.info(
                "Task cleared (now %s): Ray job %s is left running for the task's next try to adopt",
                state,
                self.submission_id,
            )
            return
        self.log.info("Task marked %s by a person: stopping Ray job %s", state, self.submission_id)
        await AsyncRayJobs(self.address).stop(self.submission_id)


ADMITTED, REFUSED, ENDED = "ADMITTED", "REFUSED", "ENDED"  # a warm job's fate, as WarmJobTrigger sees it
# A watched task of the DAG run in one of these ends a warm job's chance of admission: the previous chunk's validation
# failed, or the next chunk's train task will never admit it (failed, or skipped: a person rejected its decision).
ENDING_STATES = ("failed", "upstream_failed", "skipped")


class WarmJobTrigger(BaseTrigger):
    """A job that went on warm into chunk `chunk`, followed by a task of its own DAG run from the handoff until that
    chunk's train task admits it, so that Airflow's controls reach it while it trains ahead: the task or its DAG run
    marked failed or success (on_kill), a watched task of the DAG run ending without going on (the previous chunk's
    validation failed; the next chunk's train task failed or skipped, a person's rejection), a stall (no new step for
    `stall_after_s`, as the train task's trigger watches one; waiting for the admission is not a stall), or no
    admission by `deadline` (the admission limit) each refuse the warm chunk: the job stops at its next step boundary
    without committing anything of it (relay.trainers.session), and is stopped through Ray if it has not ended after
    `stop_grace_s`. A clear leaves the job training ahead: the task's next try follows it again. Fires ADMITTED,
    REFUSED (with who refused), ENDED (the job ended first), STALLED or TIMEOUT. Its log shows the step the job trains
    ahead at."""

    def __init__(
        self,
        address: str,
        submission_id: str,
        run_dir: str,
        chunk: int,
        deadline: float,
        poll_seconds: float = 2.0,
        watched: list[str] | None = None,
        stop_grace_s: float = 0.0,
        stall_after_s: float | None = None,
        startup_s: float = 0.0,
        from_step: int | None = None,
    ):
        super().__init__()
        self.address = address
        self.submission_id = submission_id
        self.run_dir = run_dir
        self.chunk = chunk
        self.deadline = deadline
        self.poll_seconds = poll_seconds
        self.watched = list(watched or [])  # task ids of the same DAG run whose end without going on refuses the chunk
        self.stop_grace_s = stop_grace_s
        self.stall_after_s = stall_after_s  # None: no stall watch
        self.startup_s = startup_s  # more time for the first step after the handoff (the save of `from_step` first)
        self.from_step = from_step  # the committed step the job went on from

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "address": self.address,
                "submission_id": self.submission_id,
                "run_dir": self.run_dir,
                "chunk": self.chunk,
                "deadline": self.deadline,
                "poll_seconds": self.poll_seconds,
                "watched": self.watched,
                "stop_grace_s": self.stop_grace_s,
                "stall_after_s": self.stall_after_s,
                "startup_s": self.startup_s,
                "from_step": self.from_step,
            },
        )

    def _event(self, status: str, message: str, **extra: Any) -> TriggerEvent:
        return TriggerEvent({"status": status, "submission_id": self.submission_id, "message": message, **extra})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        jobs = AsyncRayJobs(self.address)
        shown: int | None = None
        # The step it went on from is its "end step": the save and handoff after it get the startup allowance.
        watch = StallWatch(self.stall_after_s, self.startup_s, time.time(), self.from_step) if self.stall_after_s else None
        while True:
            got = await asyncio.to_thread(handoff.answer, Path(self.run_dir), self.chunk, self.submission_id)
            if got is not None:
                if got.get("admitted"):
                    yield self._event(ADMITTED, f"admitted by {got.get('by')}")
                else:
                    yield self._event(REFUSED, str(got.get("why")), by="another")
                return
            try:
                state = await jobs.get(self.submission_id)
            except Exception as e:  # noqa: BLE001 - a head restarting: the deadline still holds
                self.log.warning("Ray Jobs API at %s unreachable (%s); retrying", self.address, e)
                state = None
            if state is not None and state.status in TERMINAL:
                yield self._event(ENDED, f"job {self.submission_id} ended {state.status} before its admission")
                return
            beat, waiting = await asyncio.to_thread(heartbeat.read, self.run_dir, self.submission_id)
            if beat is not None and beat != shown:
                self.log.info(
                    "Ray job %s trains chunk %s ahead of its admission: step %s", self.submission_id, self.chunk, beat
                )
                shown = beat
            status = why = None
            if watch is not None:
                watch.saw_step(beat, time.time())
                if waiting:
                    watch.paused(time.time())
            if failed := await self._ended_tasks():
                status, why = REFUSED, f"its DAG run's {', '.join(failed)}"
            elif watch is not None and (stalled := watch.stalled(time.time())):
                status, why = STALLED, f"{stalled} while training ahead"
            elif time.time() > self.deadline:
                status, why = "TIMEOUT", "no admission within its admission limit"
            if status is not None:
                ended = await self._refuse(jobs, str(why))
                extra = {"step": watch.last_step} if watch is not None else {}
                yield self._event(status, f"{why}: its warm chunk was refused ({ended})", by="this task", **extra)
                return
            await asyncio.sleep(self.poll_seconds)

    async def _refuse(self, jobs: AsyncRayJobs, why: str, grace_s: float | None = None) -> str:
        """Refuse the warm chunk (the job stops at its next step boundary, committing nothing of it); stop the job
        through Ray if it has not ended within stop_grace_s (or `grace_s`). What happened, in words."""
        refused = await asyncio.to_thread(
            handoff.refuse_unless_admitted, Path(self.run_dir), self.chunk, self.submission_id, why
        )
        if not refused:
            return "it was admitted already: its train task follows it"
        until = time.time() + (self.stop_grace_s if grace_s is None else grace_s)
        while time.time() < until:
            try:
                state = await jobs.get(self.submission_id)
            except Exception:  # noqa: BLE001
                state = None
            if state is None or state.status in TERMINAL:
                return f"the job ended {state.status if state else 'unknown to the cluster'}"
            await asyncio.sleep(min(self.poll_seconds, 1.0))
        await jobs.stop(self.submission_id)
        return "the job was still running after its grace: stopped through Ray"

    async def _ended_tasks(self) -> list[str]:
        """The watched tasks that ended without going on, as "<task> (<state>)"."""
        if not self.watched:
            return []
        states = await _task_states(self, self.watched)
        return [f"{t} ({states[t]})" for t in self.watched if states.get(t) in ENDING_STATES]

    async def on_kill(self) -> None:
        """A person acted on the deferred task. Marked failed or success (itself, or its DAG run): refuse the warm
        chunk, so that the job stops at its next step boundary without committing anything of it. Cleared: leave the
        job training ahead; the task's next try follows it again (WarmJobOperator)."""
        state = await _own_state(self)
        if state not in (*FINAL_STATES, "unknown"):
            self.log.info(
                "Task cleared (now %s): Ray job %s trains chunk %s ahead on, for the task's next try to follow",
                state,
                self.submission_id,
                self.chunk,
            )
            return
        self.log.info(
            "Task marked %s by a person: refusing Ray job %s's warm chunk %s", state, self.submission_id, self.chunk
        )
        # Within the triggerer's on_kill timeout (30 s by default): past it, the job is stopped through Ray.
        ended = await self._refuse(
            AsyncRayJobs(self.address), f"its follow task was marked {state} by a person", grace_s=min(self.stop_grace_s, 20)
        )
        self.log.info("%s", ended)


async def _own_state(trigger: BaseTrigger) -> str:
    """The trigger's own task instance's state now, as the API server has it ("unknown" if it cannot be read)."""
    return (await _task_states(trigger, None)).get("") or "unknown"


async def _task_states(trigger: BaseTrigger, task_ids: list[str] | None) -> dict[str, str]:
    """States of `task_ids` of the trigger's own DAG run as the API server has them (None: the trigger's own task,
    under the key ""); {} when they cannot be read."""
    try:
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        ti = trigger.task_instance
        assert ti is not None  # the triggerer sets it before it runs (or kills) a trigger
        ids = task_ids if task_ids is not None else [ti.task_id]
        states = await sync_to_async(RuntimeTaskInstance.get_task_states)(
            dag_id=ti.dag_id, task_ids=ids, run_ids=[ti.run_id]
        )
        got = {k: str(v) for k, v in (states.get(ti.run_id) or {}).items()}
        return got if task_ids is not None else {"": got.get(ti.task_id, "none")}
    except Exception as e:  # noqa: BLE001 - nothing known: nothing refused for it
        trigger.log.warning("task states could not be read (%s)", e)
        return {}


class CheckpointTrigger(BaseTrigger):
    """Fire when a run's tracker has reached `step` and global_step_<step> exists, or at the deadline."""

    def __init__(self, run_dir: str, step: int, deadline: float, poll_seconds: float = 5.0):
        super().__init__()
        self.run_dir = run_dir
        self.step = step
        self.deadline = deadline
        self.poll_seconds = poll_seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"run_dir": self.run_dir, "step": self.step, "deadline": self.deadline, "poll_seconds": self.poll_seconds},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            try:
                reached = await asyncio.to_thread(checkpoint_reached, self.run_dir, self.step)
            except Exception as e:  # noqa: BLE001 - a tracker that cannot be read is the validator's to judge
                yield TriggerEvent({"status": "present", "step": self.step, "message": str(e)})
                return
            if reached:
                yield TriggerEvent({"status": "present", "step": self.step, "message": ""})
                return
            if time.time() > self.deadline:
                yield TriggerEvent(
                    {
                        "status": "timeout",
                        "step": self.step,
                        "message": f"no checkpoint for step {self.step} in {self.run_dir} before the deadline",
                    }
                )
                return
            await asyncio.sleep(self.poll_seconds)
