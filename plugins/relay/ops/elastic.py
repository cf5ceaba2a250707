"""An elastic run's world size: verl's nnodes (or n_gpus_per_node) given as [min, max] in the spec, the global batch
fixed. The size is chosen at every cold start of a chunk's job, once the run's other jobs gave their GPUs back, from
what the Ray cluster holds then (relay.jobs.cluster); the same sizing serves the DAG's train task and `relay train`.

  size        the largest allowed world size whose placement groups fit now; the latest checkpoint resharded to it
              when it was saved at another (the gate admits it, its certificate holds at the new size, S3's copy is
              replaced), and a `world_size` event. WaitForNodes when the chunk should wait: below the minimum (until
              nodes return), or after a lost node for up to elastic.wait_for_nodes_minutes (for the size it lost)
  grow        why a job that went on warm should start cold instead: the cluster holds a larger size now
  lost_nodes  the cluster's nodes that died while an attempt ran (the evidence of a `node_lost` failure)

The run's world size over time (the report's band, the goodput ledger's time below the largest) is read from its
chunk starts (relay.insights.goodput.world_sizes).

A job's world size never changes inside it (verl's worker groups are fixed at start-up): a run shrinks at the retry
after a lost node and grows back at a chunk boundary.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from relay.common.errors import RelayError
from relay.common.timestamps import epoch, event_time
from relay.jobs import cluster
from relay.jobs.ray_jobs import JobState
from relay.jobs.submission import WORLD_NODES_KEY, WORLD_SIZE_KEY
from relay.ops.reshard_run import Resharded, reshard_to_spec
from relay.preflight.world_size import latest_world_size
from relay.runs.failure_cause import EVENT as FAILED
from relay.runs.failure_cause import NODE_LOST
from relay.runs.metrics import read_events
from relay.runs.run import Run
from relay.s3.store import CheckpointStore
from relay.spec.kinds import WorldOption

EVENT = "world_size"  # events.jsonl: the size a chunk's job was given, and why (and how long it waited for it)
WAITING = "capacity_wait"  # events.jsonl: a chunk began to wait for the cluster's nodes
SETTLE_READS, SETTLE_S = 3, 3.0  # a stopped job's placement groups take a few seconds to free its GPUs


@dataclass(frozen=True)
class Sized:
    """The world size a chunk's job trains at: the checkpoint's before (None: no checkpoint), why, and the reshard."""

    option: WorldOption  # its nodes and GPUs per node
    previous: int | None
    why: str
    resharded: Resharded | None = None

    @property
    def world_size(self) -> int:
        """The processes the job trains with."""
        return self.option.world_size

    @property
    def changed(self) -> bool:
        """Whether the run's world size changed here (its latest checkpoint was saved at another)."""
        return self.previous is not None and self.previous != self.world_size


class WaitForNodes(RelayError):
    """The chunk waits for the cluster to hold `groups` (the placement groups of the world size it waits for), until
    `until` (epoch seconds; None: as long as it takes). The DAG's train task defers (no worker slot held)."""

    retry_helps = True

    def __init__(
        self, what: str, fix: str, *, groups: tuple[tuple[float, float], ...], until: float | None, below_minimum: bool
    ):
        """What the chunk waits for, and until when (see the class)."""
        super().__init__(what, fix)
        self.groups = [list(g) for g in groups]
        self.until = until
        self.below_minimum = below_minimum


def options(run: Run) -> tuple[WorldOption, ...]:
    """The run's allowed world sizes, the largest first (empty: its world size is fixed)."""
    return run.spec.core_settings.world_options


def size(
    run: Run,
    address: str,
    store: CheckpointStore | None,
    *,
    chunk: int | None,
    publish_or_fail: bool = False,
    now: float | None = None,
) -> Sized | None:
    """The world size of the chunk's next job (None: the spec's is fixed), its checkpoint resharded to it; see the
    module's docstring. Call it once the run's other jobs are stopped."""
    allowed = options(run)
    if not allowed:
        return None
    found = cluster.nodes(address)
    for _ in range(SETTLE_READS - 1):
        best = cluster.pick(allowed, found)
        if best is not None and best.world_size == allowed[0].world_size:
            break
        time.sleep(SETTLE_S)
        found = cluster.nodes(address)
    try:
        best = decide(run, found, time.time() if now is None else now)
    except WaitForNodes as wait:
        if waiting_since(run, chunk) is None:  # the wait's start, once (a waiting command asks again and again)
            run.folder.record(WAITING, chunk=chunk, below_minimum=wait.below_minimum, until=wait.until)
        raise
    previous = latest_world_size(run)
    resharded = None
    if previous is not None and previous != best.world_size:
        resharded = reshard_to_spec(run, store, publish_or_fail=publish_or_fail, world_size=best.world_size)
    largest = allowed[0].world_size
    why = _why(best, allowed, found)
    began = waiting_since(run, chunk)
    waited = round(time.time() - began, 3) if began is not None else None
    run.folder.record(
        EVENT, chunk=chunk, world_size=best.world_size, previous=previous, largest=largest, why=why, waited_s=waited
    )
    return Sized(best, previous, why, resharded)


def waiting_since(run: Run, chunk: int | None) -> float | None:
    """When the chunk began its current wait for nodes (None: it is not waiting)."""
    for e in reversed(read_events(run.dir)):
        if e.get("event") == EVENT:
            return None
        if e.get("event") == WAITING and e.get("chunk") == chunk:
            return epoch(e.get("time"))
    return None


def next_size(run: Run, address: str) -> str | None:
    """What size the run's next cold start would train at and why, or what it would wait for (`relay plan`, `relay
    doctor`); None for a fixed world size. Nothing is resharded or recorded."""
    allowed = options(run)
    if not allowed:
        return None
    found = cluster.nodes(address)
    try:
        best = decide(run, found, time.time())
    except WaitForNodes as wait:
        return f"the next chunk would wait: {wait.what}"
    have = latest_world_size(run)
    then = "" if have in (None, best.world_size) else f"; its step at world size {have} would be resharded first"
    why = _why(best, allowed, found)
    return f"the next chunk would train at world size {best.world_size} of {_range(allowed)}: {why}{then}"


def decide(run: Run, found: list[cluster.Node], now: float) -> WorldOption:
    """The world size to train at on the cluster `found`, or WaitForNodes (see the module's docstring)."""
    allowed = options(run)
    best = cluster.pick(allowed, found)
    wait_s = run.spec.elastic.wait_for_nodes_minutes * 60
    loss = unsettled_loss(run)
    if loss is not None and (best is None or best.world_size < loss[1]) and now < loss[0] + wait_s:
        lost = next((o for o in allowed if o.world_size <= loss[1]), allowed[0])
        until = loss[0] + wait_s
        raise WaitForNodes(
            f"run {run}: a node was lost under its world-size-{loss[1]} job at {event_time(loss[0])}; the cluster holds "
            f"{best.describe() if best else 'less than the minimum'} now ({free_text(found)})",
            f"nothing: the chunk waits until {event_time(until)} (elastic.wait_for_nodes_minutes) for the nodes to "
            "return, then goes on at the largest world size the cluster holds",
            groups=lost.groups,
            until=until,
            below_minimum=False,
        )
    if best is None:
        smallest = allowed[-1]
        raise WaitForNodes(
            f"run {run}: the Ray cluster holds less than the run's minimum, {smallest.describe()} ({free_text(found)})",
            "start nodes (the chunk waits without holding a worker slot and goes on when they are up), or lower the "
            "minimum of trainer.settings.nnodes",
            groups=smallest.groups,
            until=None,
            below_minimum=True,
        )
    return best


def _why(best: WorldOption, allowed: tuple[WorldOption, ...], found: list[cluster.Node]) -> str:
    largest = allowed[0].world_size
    return f"the cluster holds {best.describe()}" + (
        "" if best.world_size == largest else f", below the spec's largest, {largest} ({free_text(found)})"
    )


def _range(allowed: tuple[WorldOption, ...]) -> str:
    return f"{allowed[-1].world_size}..{allowed[0].world_size}"


def unsettled_loss(run: Run) -> tuple[float, int] | None:
    """(when, the world size of the job that lost it) of the run's newest `node_lost` failure that no sizing came
    after: its retry waits for that size for up to elastic.wait_for_nodes_minutes."""
    events = read_events(run.dir)
    sizes = {e.get("attempt"): e.get("world_size") for e in events if e.get("event") == "chunk_start"}
    for e in reversed(events):
        if e.get("event") == EVENT:
            return None
        if e.get("event") == FAILED and e.get("cause") == NODE_LOST:
            when, had = epoch(e.get("time")), sizes.get(e.get("attempt"))
            return (when, int(had)) if when is not None and had else None
    return None


def grow(run: Run, address: str) -> Callable[[JobState], str | None] | None:
    """Why a job that went on warm should start cold instead (the cluster holds a larger world size now than the
    job's, counting its own GPUs as its), or None; None for a fixed world size."""
    allowed = options(run)
    if not allowed:
        return None

    def larger(state: JobState) -> str | None:
        have, on = int(state.metadata.get(WORLD_SIZE_KEY) or 0), int(state.metadata.get(WORLD_NODES_KEY) or 0)
        current = next((o for o in allowed if o.world_size == have and on in (0, o.nnodes)), None)
        if current is None:
            return None
        try:
            found = cluster.nodes(address)
        except RelayError:  # no answer: the warm job goes on at its size
            return None
        for bigger in allowed:
            if bigger.world_size <= have:
                return None
            extra = list((Counter(bigger.groups) - Counter(current.groups)).elements())
            if cluster.fits(extra, found):
                return f"the cluster holds {bigger.describe()} now, more than the job's world size {have}"
        return None

    return larger


def lost_nodes(address: str, run: Run, attempt: str, *, settle_s: float = 0.0) -> list[str]:
    """The cluster's nodes that died while `attempt` ran, in words (empty when none, or the cluster does not say).
    settle_s: how long to wait for the head to declare a node dead (a job's peers fail on a lost rank within seconds;
    the head declares its node dead only after its health checks, tens of seconds)."""
    began = next((epoch(e.get("time")) for e in read_events(run.dir) if e.get("attempt") == attempt), None)
    if began is None:
        return []
    deadline = time.time() + settle_s
    while True:
        try:
            lost = cluster.lost_since(cluster.nodes(address), began)
        except RelayError:
            lost = []
        if lost or time.time() >= deadline:
            break
        time.sleep(2.0)
    return [
        f"Ray node {n.name} ({n.node_id[:12]}, {n.gpus:g} GPU) died at {event_time(n.ended_at or 0)} while the job ran"
        for n in lost
    ]


# Ray's head declares a node dead after health_check_failure_threshold x health_check_period_ms (5 x 3 s by default;
# the local stack's 10 x 3 s on a loaded host) plus the check's own timeout: an elastic run's failure that a lost node
# could explain waits this long for the head's word before it is classified.
NODE_DEATH_SETTLE_S = 60.0
SUSPECTS = ("collective_timeout", "preempted", "unknown", "node_lost", "stalled")  # a lost node could be behind


def death_settle_s(run: Run, suspect: str) -> float:
    """How long a failure of the run classified `suspect` (without the cluster's word) waits for a node's death."""
    return NODE_DEATH_SETTLE_S if options(run) and suspect in SUSPECTS else 0.0


def free_text(found: list[cluster.Node]) -> str:
    """What the live nodes have free, in words (a worker needs CPUs beside its GPU)."""
    live = [n for n in found if n.alive and n.gpus]  # a node without GPUs (a CPU-only head) holds no worker
    return (
        "; ".join(f"{n.name}: {n.gpus_free:g} of {n.gpus:g} GPU and {n.cpus_free:g} of {n.cpus:g} CPU free" for n in live)
        or "no live node with GPUs"
    )


def wait_here(
    run: Run, address: str, store: CheckpointStore | None, *, chunk: int | None, say: Callable[[str], None]
) -> Sized | None:
    """size(), waiting in this process while the chunk should wait (`relay train`: Ctrl-C stops it)."""
    while True:
        try:
            return size(run, address, store, chunk=chunk)
        except WaitForNodes as wait:
            say(f"{wait.what}; {wait.fix}")
            left = (wait.until - time.time()) if wait.until is not None else run.spec.elastic.poll_seconds
            time.sleep(max(1.0, min(run.spec.elastic.poll_seconds, left)))
