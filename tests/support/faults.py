"""Helpers of the fault suite (tests/faults/): the fork server client, and `fault_row`, the fixture
through which each fault case records its row of docs/FAULTS.md (the fault, what Relay did, the
steps lost, whether data was lost). Rows travel as a junit property (`relay_fault`), so
`scripts/faults_report.py JUNIT.xml` builds docs/FAULTS.md from the test results alone, with each
case's outcome: a row is never written by hand.

Full-stack cases added later (Ray head death, scheduler kill, S3 stopped, disk full...) record
their row the same way: `fault_row(case="s3-stopped", fault=..., action=..., steps_lost=..., layer="full stack")`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROPERTY = "relay_fault"


@pytest.fixture
def fault_row(record_property):
    """record(case, fault, action, steps_lost, data_lost="no", layer="trainer"): this case's row of
    docs/FAULTS.md. `case` is the fault's id in scripts/faults_report.py's PLANNED list (trainer-kill,
    s3-errors, new-worker-host, ray-orphan...). Call it last, once the case's assertions have passed."""

    def record(case: str, fault: str, action: str, steps_lost: int | str, data_lost: str = "no",
               layer: str = "trainer", **extra) -> None:
        record_property(PROPERTY, json.dumps({"case": case, "fault": fault, "action": action,
                                              "steps_lost": steps_lost, "data_lost": data_lost, "layer": layer,
                                              **extra}, sort_keys=True))

    return record


class ForkServer:
    """A client of tests/support/forkserver.py: `relay train` children forked from one warm process."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / "forkserver.py")],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONWARNINGS": "ignore"})

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died (exit {self.proc.poll()})")
        return json.loads(line)

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> int:
        return self._ask({"argv": argv, "env": env or {}, "log": str(log)})["pid"]

    def wait(self, pid: int) -> int:
        return self._ask({"wait": pid})["rc"]

    def run(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> int:
        return self.wait(self.start(argv, log, env))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def wait_for_line(log: Path, marker: str, pid: int, timeout: float = 120) -> str:
    """The first line of `log` that holds `marker`; fails if the process ends or time runs out first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        for line in text.splitlines():
            if marker in line:
                return line
        if not _alive(pid):
            raise AssertionError(f"process {pid} ended before printing {marker!r}:\n{text[-3000:]}")
        time.sleep(0.02)
    raise AssertionError(f"no {marker!r} from process {pid} within {timeout}s:\n{log.read_text()[-3000:]}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (ended, not yet reaped by the fork server) counts as ended
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
