"""The triggers a run DAG's tasks defer to, so that no worker slot is held while a Ray job trains or a checkpoint is
awaited: RayJobTrigger (a chunk's or a validation's job), WarmJobTrigger (a job training the next chunk ahead of its
admission) and CheckpointTrigger. Each serialize() mirrors its __init__; run() follows through relay.ops.follow_job
and fires one event with how the wait ended (never an exception).

What stays here is Airflow's: a person's mark-failed or mark-success calls on_kill, which stops the job (or refuses
the warm chunk); a clear calls it too, and then the job is left for the task's next try to adopt or follow; Airflow's
own defer timeout kills a trigger without calling on_kill (so the chunk's deadline is enforced while following); a
triggerer restart does neither, and the new triggerer re-attaches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from asgiref.sync import sync_to_async

from relay.ops import follow_job
from relay.ops.follow_job import ADMITTED, ENDED, HANDED_OFF, REFUSED, STALLED

__all__ = ["ADMITTED", "ENDED", "HANDED_OFF", "REFUSED", "STALLED", "CheckpointTrigger", "RayJobTrigger", "WarmJobTrigger"]

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
        watch = follow_job.ChunkWatch(
            deadline=self.deadline,
            poll_seconds=self.poll_seconds,
            unreachable_grace_s=self.unreachable_grace_s,
            stall_after_s=self.stall_after_s,
            startup_s=self.startup_s,
            end_step=self.end_step,
            stop_grace_s=self.stop_grace_s,
            run_dir=self.run_dir,
            handoff_chunk=self.handoff_chunk,
        )
        ended = await follow_job.chunk_job(self.address, self.submission_id, watch, self.log.info, self.log.warning)
        yield self._event(ended.status, ended.message, **ended.extra)

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
        await follow_job.stop(self.address, self.submission_id)


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

    def _watch(self) -> follow_job.WarmWatch:
        return follow_job.WarmWatch(
            run_dir=self.run_dir,
            chunk=self.chunk,
            deadline=self.deadline,
            poll_seconds=self.poll_seconds,
            stop_grace_s=self.stop_grace_s,
            stall_after_s=self.stall_after_s,
            startup_s=self.startup_s,
            from_step=self.from_step,
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        ended = await follow_job.warm_job(
            self.address, self.submission_id, self._watch(), self._ended_tasks, self.log.info, self.log.warning
        )
        yield self._event(ended.status, ended.message, **ended.extra)

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
        ended = await follow_job.refuse_warm(
            self.address,
            self.submission_id,
            self._watch(),
            f"its follow task was marked {state} by a person",
            grace_s=min(self.stop_grace_s, 20),
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
        ended = await follow_job.checkpoint(self.run_dir, self.step, self.deadline, self.poll_seconds)
        yield TriggerEvent({"status": ended.status, "step": self.step, "message": ended.message})


class CapacityTrigger(BaseTrigger):
    """Fire when the Ray cluster holds the placement groups an elastic chunk waits for ([CPUs, GPUs] each, one node
    each), or at `until` (epoch seconds; None: no end): relay.ops.follow_job.capacity."""

    def __init__(self, address: str, groups: list[list[float]], until: float | None, poll_seconds: float = 15.0):
        super().__init__()
        self.address = address
        self.groups = groups
        self.until = until
        self.poll_seconds = poll_seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"address": self.address, "groups": self.groups, "until": self.until, "poll_seconds": self.poll_seconds},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        ended = await follow_job.capacity(self.address, self.groups, self.until, self.poll_seconds)
        yield TriggerEvent({"status": ended.status, "message": ended.message})
