"""Why a chunk's attempt failed: one classification, shared by the train task (its message and whether
Airflow retries), the alerts and `relay doctor`.

The evidence is what a person would read: the Ray job's status and message, its driver's exit code (a
negative code, or 128+N from the shell Ray starts it with, is signal N) and a bounded tail of its log.
The rules go from the most specific evidence to the least: Relay's own `[relay] cause:` line (which also
says whether a retry can help), then a node of the cluster that died while the job ran (the dashboard's state
API), then a line that names the cause wherever it is (CUDA out of memory, a
NCCL watchdog, Ray's memory monitor killing a worker on any node); then a traceback, which outranks
keywords: the exception it ends in is an exception of the training code, unless its own text says a node
was lost or a collective timed out, even when its message mentions a preemption or its type is
ConnectionRefusedError (a reward function's, say). Keywords of infrastructure and lost nodes count only
without a traceback. A bare SIGKILL is an OOM kill only with evidence of one (the cgroup's `oom_kill` count
rose); otherwise it came from outside (preemption, a lost node).

Each cause has a policy (spec `airflow.retry_on`, defaults in POLICY): retry; retry after a backoff
(`airflow.retry_backoff_seconds`); or stop without retrying. An exception raised at the same step with
the same message in two tries of a chunk is deterministic: retrying cannot help, so it stops whatever
the policy says (`repeats`).
"""

from __future__ import annotations

import re
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relay.common.errors import LeaseLost
from relay.runs import layout
from relay.runs.folder import RunFolder
from relay.runs.metrics import read_events, read_jsonl, record_event

# The classification's callers name causes here: re-exported from the vocabulary (relay.spec.causes).
from relay.spec.causes import ACCELERATOR_OOM as ACCELERATOR_OOM
from relay.spec.causes import BACKOFF as BACKOFF
from relay.spec.causes import CAUSES as CAUSES
from relay.spec.causes import COLLECTIVE_TIMEOUT as COLLECTIVE_TIMEOUT
from relay.spec.causes import EXCEPTION as EXCEPTION
from relay.spec.causes import HOST_OOM as HOST_OOM
from relay.spec.causes import INFRASTRUCTURE as INFRASTRUCTURE
from relay.spec.causes import NODE_LOST as NODE_LOST
from relay.spec.causes import POLICIES as POLICIES
from relay.spec.causes import PREEMPTED as PREEMPTED
from relay.spec.causes import REFUSED as REFUSED
from relay.spec.causes import RETRY as RETRY
from relay.spec.causes import STALLED as STALLED
from relay.spec.causes import STOP as STOP
from relay.spec.causes import UNKNOWN as UNKNOWN

EVENT = "chunk_failed"  # events.jsonl: one per failed attempt, {chunk, attempt, cause, step, signature, ...}

# Relay's own errors name their cause on a line of the job's log (relay.trainers.job), and whether a retry helps.
RELAY_CAUSE_LINE = re.compile(r"^\[relay\] cause: (\w+)(?: \([\w.]+; a retry (can|cannot) help\))?")
ACCELERATOR_OOM_LINES = re.compile(
    r"CUDA out of memory|HIP out of memory|NPU out of memory|OutOfMemoryError: (CUDA|HIP|NPU)|"
    r"torch\.cuda\.OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDA error: out of memory"
)
HOST_OOM_LINES = re.compile(
    r"(^|[^\w.])MemoryError\b|[Cc]annot allocate memory|std::bad_alloc|ray\.exceptions\.OutOfMemoryError|"
    r"node running low on memory|NODE_OUT_OF_MEMORY|Out of memory: Killed process|oom-kill"
)
COLLECTIVE_LINES = re.compile(
    r"Watchdog caught collective operation timeout|DistNetworkError|DistStoreError|ProcessGroupNCCL.*[Tt]imeout|"
    r"NCCL (communicator was aborted|error.*[Tt]imeout)|[Gg]loo.*(Timed out|timed out|Connection closed by peer)"
)
NODE_LOST_LINES = re.compile(
    r"NodeDiedError|node (\S+ )?(has )?died|node was terminated|The node with node id \S+ .*(died|dead)|"
    r"raylet (has )?died|ActorDiedError.*node|Node (\S+ )?is dead",
    re.IGNORECASE,
)
PREEMPTED_LINES = re.compile(r"preempted", re.IGNORECASE)  # a keyword: outranked by a traceback
# A worker that died without an error of its own: killed from outside (an OOM killer, a preemption, `ray stop`).
# Ray's text lists the OOM killer among "some common causes": which one it was takes evidence (the nodes' counts).
WORKER_KILLED_LINES = re.compile(
    r"(actor|worker) died unexpectedly|(worker|process) was killed by SIGKILL|Worker exit type: SYSTEM_ERROR|"
    r"WorkerCrashedError|worker crashed unexpectedly",
    re.IGNORECASE,
)
INFRA_LINES = re.compile(
    r"EndpointConnectionError|Could not connect to the endpoint URL|ConnectionRefusedError|"
    r"cannot reach the Ray|Ray Jobs API .* unreachable|Failed to connect to GCS|NoCredentialsError"
)
LINE_PREFIX = re.compile(r"^(?:\[(?:rank|default)\d+\]:\s?|\([\w.:]+ pid=\d+(?:, ip=[\d.]+)?\)\s)+")
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours a worker's prefix
TRACEBACK = "Traceback (most recent call last):"
EXCEPTION_LINE = re.compile(
    r"^(?:ray\.exceptions\.RayTaskError\((\w+)\): .*|([A-Za-z_][\w.]*(?:Error|Exception|Exit|"
    r"Interrupt|Warning)\b)(?::\s?(.*))?)$"
)


@dataclass
class Cause:
    """A classified failure: `cause` (a key of CAUSES), the step it happened at (None: not known), the
    log lines that show it, and for an exception its signature (type: message) to tell a repeat."""

    cause: str
    step: int | None = None
    evidence: list[str] = field(default_factory=list)
    signature: str | None = None
    exit_code: int | None = None
    retry_helps: bool | None = None  # what Relay's own error said (None: not said)

    @property
    def title(self) -> str:
        return CAUSES[self.cause][0]

    @property
    def todo(self) -> str:
        return CAUSES[self.cause][2]

    def describe(self) -> str:
        """One line: the cause, the step, the signature."""
        at = f" at step {self.step}" if self.step is not None else ""
        sig = f" ({self.signature})" if self.signature else ""
        return f"cause: {self.cause}{at}, {self.title}{sig}"

    def report(self) -> str:
        """The lines a task log and an alert carry: the cause, the evidence, what to do."""
        lines = [self.describe()]
        if self.evidence:
            lines += ["evidence:", *(f"  {line}" for line in self.evidence)]
        lines.append(f"what to do: {self.todo}")
        return "\n".join(lines)

    def to_event(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, [])}


def signal_of(exit_code: int | None) -> int | None:
    """The signal that ended the driver: subprocess reports -N; the shell Ray runs it in reports 128+N."""
    if exit_code is None:
        return None
    if exit_code < 0:
        return -exit_code
    if 128 < exit_code < 160:
        return exit_code - 128
    return None


def classify(
    status: str,
    message: str = "",
    log_tail: str = "",
    exit_code: int | None = None,
    *,
    step: int | None = None,
    oom_kills: int = 0,
    oom_nodes: list[str] | None = None,
    lost_nodes: list[str] | None = None,
) -> Cause:
    """The cause of a failed chunk attempt. status: the Ray job's (FAILED, STOPPED) or the trigger's own
    (STALLED, TIMEOUT, LOST, UNREACHABLE); message: Ray's message (it ends with the log's last lines);
    log_tail: the job's last log lines; step: the step it failed at; oom_kills: how many processes the
    kernel's OOM killer ended in the job's cgroup while it ran (evidence for a bare SIGKILL); oom_nodes: the nodes
    whose kernel OOM-kill count rose while it ran, in words (relay.jobs.node_oom.rises: evidence for a killed
    worker on any node); lost_nodes: the cluster's nodes that died while it ran, in words (relay.jobs.cluster: a
    lost node explains its actors' deaths and its peers' collective timeouts)."""

    lines = unprefixed(log_tail or message or "")
    msg_lines = unprefixed(message or "")
    sig = signal_of(exit_code)

    def found(pattern: re.Pattern[str]) -> list[str]:
        return [ln[:300] for ln in lines + msg_lines if pattern.search(ln)][-3:]

    def made(cause: str, evidence: list[str], signature: str | None = None, retry_helps: bool | None = None) -> Cause:
        return Cause(cause, step, list(dict.fromkeys(evidence)), signature, exit_code, retry_helps)

    if status == "NODE_LOST":  # the trigger saw a node of the job's die and stopped it
        return made(NODE_LOST, [*(lost_nodes or []), message[:300]])
    if status in ("STALLED", "TIMEOUT") and lost_nodes:  # its peers waited on the lost node's ranks
        return made(NODE_LOST, [*lost_nodes, message[:300]])
    if status in ("STALLED", "TIMEOUT"):
        return made(STALLED, [message[:300]] if message else [])
    if status == "UNREACHABLE":
        return made(INFRASTRUCTURE, [message[:300]])
    if status == "LOST":
        return made(PREEMPTED, [message[:300]])
    relay = [m for ln in lines if (m := RELAY_CAUSE_LINE.match(ln))]
    if relay and relay[-1].group(1) in CAUSES:
        said = [ln for ln in lines if ln.startswith("[relay] chunk") and (" failed" in ln or " stopped" in ln)][-1:]
        helps = {"can": True, "cannot": False}.get(relay[-1].group(2) or "")
        return made(relay[-1].group(1), [*said, relay[-1].group(0)], retry_helps=helps)
    if lost_nodes:
        return made(NODE_LOST, [*lost_nodes, *(found(NODE_LOST_LINES) or found(COLLECTIVE_LINES))[-1:]])
    if ev := found(ACCELERATOR_OOM_LINES):
        return made(ACCELERATOR_OOM, ev)
    if ev := found(HOST_OOM_LINES):
        return made(HOST_OOM, ev)
    killed = found(WORKER_KILLED_LINES)
    if (killed or sig == signal.SIGKILL) and oom_nodes:
        return made(HOST_OOM, [*oom_nodes, *killed[-1:]])
    if sig == signal.SIGKILL and oom_kills > 0:
        return made(
            HOST_OOM,
            [
                f"the driver was killed by SIGKILL and the kernel's OOM killer ended {oom_kills} "
                "process(es) in the job's cgroup while it ran"
            ],
        )
    if ev := found(COLLECTIVE_LINES):
        return made(COLLECTIVE_TIMEOUT, ev)
    if exc := last_exception(lines) or last_exception(msg_lines):  # a long traceback outgrows a short tail
        signature, evidence = exc
        if NODE_LOST_LINES.search(signature):  # a lost node shows as an actor's traceback
            return made(NODE_LOST, evidence, signature)
        if killed and re.match(r"(ActorDiedError|RayActorError|WorkerCrashedError|ActorUnavailableError)\b", signature):
            # killed from outside, and no node's OOM-kill count rose: preempted, not the training code's exception
            return made(PREEMPTED, [*killed[-1:], *evidence], signature)
        return made(EXCEPTION, evidence, signature)
    if ev := found(INFRA_LINES):
        return made(INFRASTRUCTURE, ev)
    if ev := found(NODE_LOST_LINES):
        return made(NODE_LOST, ev)
    if ev := found(PREEMPTED_LINES):
        return made(PREEMPTED, ev)
    if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP) or status == "STOPPED":
        what = (
            f"the driver was ended by {signal.Signals(sig).name} (exit code {exit_code}) with no error of its own"
            if sig
            else "the job was stopped (`ray job stop` or the cluster)"
        )
        return made(PREEMPTED, [what, *lines[-2:]])
    return made(UNKNOWN, lines[-3:])


def could_be_oom_kill(message: str, log_tail: str, exit_code: int | None) -> bool:
    """Whether a failure is one an OOM kill explains (the driver SIGKILLed, a worker killed): then the nodes' OOM-kill
    counts are worth reading (relay.jobs.node_oom)."""
    lines = unprefixed(log_tail) + unprefixed(message)
    return signal_of(exit_code) == signal.SIGKILL or any(WORKER_KILLED_LINES.search(ln) for ln in lines)


def unprefixed(log: str) -> list[str]:
    """A log's non-empty lines without the prefixes that torch.distributed (`[rank0]: `) and Ray (`(WorkerDict
    pid=12, ip=10.0.0.2) `) put before a worker's own output: a traceback reads as its process printed it."""
    return [LINE_PREFIX.sub("", ANSI.sub("", ln).rstrip(), count=1) for ln in log.splitlines() if ln.strip()]


def last_exception(lines: list[str]) -> tuple[str, list[str]] | None:
    """(signature, evidence) of the last Python exception in a log: its `Type: message` line, and the
    traceback's last frame and that line. None when the log shows no traceback."""
    starts = [i for i, ln in enumerate(lines) if ln.strip() == TRACEBACK]
    if not starts:
        return None
    tb = lines[starts[-1] + 1 :]
    for i, ln in enumerate(tb):
        m = EXCEPTION_LINE.match(ln.strip())
        if m and not ln.startswith((" ", "\t")):
            typ = m.group(1) or m.group(2)
            text = (m.group(3) or "").strip() if m.group(2) else ln.strip().partition("): ")[2]
            if m.group(1):  # Ray's wrapper names the actor and its pid: the wrapped exception's own line, if shown
                inner = [
                    (j, x)
                    for j, x in enumerate(tb[i + 1 :], i + 1)
                    if not x.startswith((" ", "\t"))
                    and (n := EXCEPTION_LINE.match(x.strip()))
                    and n.group(2)
                    and n.group(2).rpartition(".")[2] == typ
                ]
                if inner:
                    i, ln = inner[-1]
                    text = (EXCEPTION_LINE.match(ln.strip()).group(3) or "").strip()  # type: ignore[union-attr]
            frames = [f.strip() for f in tb[:i] if f.strip().startswith("File ")]
            return f"{typ.rpartition('.')[2]}: {text}"[:200], [*frames[-1:], ln.strip()[:300]]
    return None


def policy(cause: Cause, retry_on: Mapping[str, str] | None = None) -> str:
    """retry, backoff or stop: the spec's `airflow.retry_on` for this cause; else what Relay's own error said
    (stop when a retry cannot help, never stop when it can); else the cause's default."""
    default = CAUSES[cause.cause][1]
    if cause.retry_helps is not None:
        default = STOP if not cause.retry_helps else (RETRY if default == STOP else default)
    return (retry_on or {}).get(cause.cause) or default


def repeats(cause: Cause, earlier: list[dict[str, Any]]) -> bool:
    """Whether an earlier failure of the same chunk (its `chunk_failed` events) was the same exception at
    the same step: deterministic, so another try would fail the same way."""
    return (
        cause.cause == EXCEPTION
        and cause.step is not None
        and any(
            e.get("cause") == EXCEPTION and e.get("step") == cause.step and e.get("signature") == cause.signature
            for e in earlier
        )
    )


def cgroup_oom_kills(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc")) -> int | None:
    """How many processes the kernel's OOM killer has ended: in this process's memory cgroup (v2
    memory.events, v1 memory.oom_control), else on the whole host (/proc/vmstat); None where none can be read."""
    v1 = ""
    try:
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            _, controllers, where = line.split(":", 2)
            if "memory" in controllers.split(","):
                v1 = where.lstrip("/")
    except (OSError, ValueError):
        pass
    for counts in (root / "memory.events", root / "memory" / v1 / "memory.oom_control", proc / "vmstat"):
        if (count := oom_kill_count(counts)) is not None:
            return count
    return None


def oom_kill_count(path: Path) -> int | None:
    """The `oom_kill` line of a kernel counters file (/proc/vmstat, a cgroup's memory.events); None where there is none."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def step_of_failure(run_dir: Path, attempt: str) -> int | None:
    """The step an attempt failed at: the one after the last step it trained (or after its resume point).
    None when it never started training (it failed before its chunk_start event)."""
    start = _chunk_start(run_dir, attempt)
    if start is None:
        return None
    trained: list[int] = [
        r["step"]
        for r in read_jsonl(Path(run_dir) / layout.METRICS)
        if r.get("attempt") == attempt and isinstance(r.get("step"), int)
    ]
    return max(trained or [start.get("resumed_from") or 0]) + 1


def record_failure(
    run: Path | RunFolder, cause: Cause, *, chunk: int | None, attempt: str, **fields: Any
) -> dict[str, Any] | None:
    """The `chunk_failed` event of an attempt (what `repeats` compares, what the report counts). None when the
    run has no folder yet (its first job failed before making one), it cannot be written, or (a RunFolder) the run
    was started again since: the failure being reported matters more than its record, and an old incarnation's
    failure never lands in the new one."""
    run_dir = run.path if isinstance(run, RunFolder) else Path(run)
    if not run_dir.is_dir():
        return None
    try:
        if isinstance(run, RunFolder):
            return run.record(EVENT, chunk=chunk, attempt=attempt, **cause.to_event(), **fields)
        return record_event(run_dir, EVENT, chunk=chunk, attempt=attempt, **cause.to_event(), **fields)
    except (OSError, LeaseLost) as e:
        print(f"[relay] {run_dir}: the failure's event was not recorded ({e})", file=sys.stderr)
        return None


def earlier_failures(run_dir: Path, chunk: int, scope: str | None = None) -> list[dict[str, Any]]:
    """The chunk's `chunk_failed` events, of one DAG run when `scope` (its run id) is given."""
    return [
        e
        for e in read_events(run_dir)
        if e.get("event") == EVENT and e.get("chunk") == chunk and (scope is None or e.get("dag_run") == scope)
    ]


def oom_kills_since_start(run_dir: Path, attempt: str) -> int:
    """How many processes the OOM killer ended since the attempt's chunk_start, where that can be known:
    its trainer recorded the count on this same host (a local head; otherwise 0: no evidence)."""
    start = _chunk_start(run_dir, attempt)
    if start is None or start.get("host") != socket.gethostname() or start.get("oom_kills") is None:
        return 0
    now = cgroup_oom_kills()
    return max(0, now - start["oom_kills"]) if now is not None else 0


def _chunk_start(run_dir: Path, attempt: str) -> dict[str, Any] | None:
    """The attempt's (last) chunk_start event: where it resumed from, its host, the OOM killer's count then."""
    return next(
        (e for e in reversed(read_events(run_dir)) if e.get("event") == "chunk_start" and e.get("attempt") == attempt), None
    )
