"""Graceful stops: a trainer asked to stop finishes the step it is in, commits a checkpoint of it under the
run's lease and ends with StoppedEarly (exit code 4, cause `preempted`), so that the chunk's retry resumes
there with no step lost.

What asks a trainer to stop:
- SIGTERM in its own process: Kubernetes ending a pod, a spot notice's handler, `ray job stop` (Ray sends it
  to the job's driver and waits RAY_JOB_STOP_WAIT_TIME_S, which Relay sets to `ray.stop_grace_seconds`,
  before its SIGKILL), Relay's own stop of a stalled or late job, `relay train` getting SIGTERM;
- a stop request file, `.relay/stop/<attempt>` in the run's folder: verl trains in its TaskRunner actor, a
  process Ray does not signal, so verl's job driver writes the file when it gets SIGTERM and the actor reads it
  after each step;
- the spec's `save_before`: a wall-clock deadline (a reservation's end), checked after each step: when the next
  step and a save would not both end before it, the trainer saves now.

Before the first step there is nothing to save: a SIGTERM then ends the process at once. A trainer that no
longer holds the run's lease (a newer attempt took it) cannot save: its commit is refused (LeaseLost), and it
ends without writing.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from relay.common import files
from relay.common.errors import StoppedEarly
from relay.runs import layout

STOP_DIR = "stop"
SAVE_GUESS_S = 60.0  # a save's cost before this run has measured one
MARGIN = 1.2  # the next step and a save, with this much to spare, must end before save_before


def stop_file(run_dir: Path, attempt: str) -> Path:
    """The stop request of one attempt of a run (its name is the attempt's, made safe for a file name)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in attempt)
    return layout.relay_dir(Path(run_dir), STOP_DIR, safe)


def request_stop(run_dir: Path, attempt: str, why: str) -> Path:
    """Ask the trainer of `attempt` to stop after its current step (what verl's job driver does on SIGTERM)."""
    path = stop_file(run_dir, attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.atomic_write(path, why.encode())
    return path


class GracefulStop:
    """Whether the trainer of one attempt should stop after the step it has just trained, and why.

    signals=True (the process that Ray or Kubernetes signals, in its main thread): SIGTERM asks for the stop;
    before training_started() (or, for a trainer in another process, before started() says so) it ends the
    process at once (StoppedEarly: nothing trained, nothing to save); `forward` passes the request on (verl's
    driver: to its actor, through the stop file). A stale stop file of the same attempt name (`relay train`
    attempts share one) is removed first."""

    def __init__(
        self, run_dir: Path, attempt: str, deadline: float | None = None, *, signals: bool = True, forward=None, started=None
    ):
        self.run_dir, self.attempt, self.deadline = Path(run_dir), attempt, deadline
        self.reason: str | None = None
        self.training = False
        self._forward = forward
        self._started = started  # () -> bool: has training begun elsewhere (verl's actor), for a SIGTERM
        self._owner = signals  # its stop file is its own to remove
        self._installed = False
        self._previous = None
        if signals:
            stop_file(self.run_dir, attempt).unlink(missing_ok=True)
            if threading.current_thread() is threading.main_thread():
                self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
                self._installed = True

    def install(self) -> None:
        """Take SIGTERM back (ray.init installs a handler of its own that exits the driver at once)."""
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if not (self.training or (self._started is not None and self._started())):
            raise StoppedEarly(
                "SIGTERM before the first step: nothing was trained, so nothing needed saving",
                "nothing: the retry resumes from the latest checkpoint",
            )
        if self.reason is None:
            self.reason = "SIGTERM"
            print("[relay] SIGTERM: finishing this step, then saving a checkpoint of it", flush=True)
            if self._forward is not None:
                self._forward(self.reason)

    def training_started(self) -> None:
        """From here a SIGTERM waits for the step's end (and its save) instead of ending the process."""
        self.training = True

    def ask(self, why: str) -> None:
        self.reason = self.reason or why

    def check(self, step_seconds: list[float], save_seconds: float | None) -> str | None:
        """Why to stop before the next step (the signal, a stop request, the deadline); None to train on.
        step_seconds: the recent steps' durations; save_seconds: what the last save took (None: not known)."""
        if self.reason is None and stop_file(self.run_dir, self.attempt).is_file():
            said = stop_file(self.run_dir, self.attempt).read_text(errors="replace").strip()
            self.reason = f"a stop request ({said or 'no reason given'})"
        if self.reason is None and self.deadline is not None:
            need = time_needed(step_seconds, save_seconds)
            left = self.deadline - time.time()
            if left < need:
                at = datetime.fromtimestamp(self.deadline, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                self.reason = (
                    f"save_before {at}: {max(left, 0):.0f}s left, and another step and a save need about {need:.0f}s"
                )
        return self.reason

    def close(self) -> None:
        """Put back the SIGTERM handler there was before, and remove this attempt's stop request."""
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
        if self._owner:
            stop_file(self.run_dir, self.attempt).unlink(missing_ok=True)


def time_needed(step_seconds: list[float], save_seconds: float | None) -> float:
    """Seconds the next step and a save take, with MARGIN to spare: the slowest of the last 5 steps, the last
    save (or SAVE_GUESS_S before one was measured)."""
    step = max(step_seconds[-5:]) if step_seconds else 0.0
    save = save_seconds if save_seconds is not None and math.isfinite(save_seconds) else SAVE_GUESS_S
    return (step + save) * MARGIN
