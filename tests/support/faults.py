"""Helpers of the fault suite (`pytest -m fault`): the fork server client, and `fault_row`, the fixture
through which each fault case records its row of docs/FAULTS.md (the fault, what Relay did, the
steps lost, whether data was lost). Rows travel as a junit property (`relay_fault`), so
`scripts/faults_report.py JUNIT.xml` builds docs/FAULTS.md from the test results alone, with each
case's outcome: a row is never written by hand. tests/conftest.py makes `fault_row` every test's fixture;
a case outside tests/faults/ is marked `@pytest.mark.fault`.
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
        if not alive(pid):
            raise AssertionError(f"process {pid} ended before printing {marker!r}:\n{text[-3000:]}")
        time.sleep(0.02)
    raise AssertionError(f"no {marker!r} from process {pid} within {timeout}s:\n{log.read_text()[-3000:]}")


def alive(pid: int) -> bool:
    """Is the process running? A zombie (ended, not yet reaped) counts as ended."""
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


def assert_finished_as(run_dir: Path, baseline: dict, steps: int, out: str = "") -> None:
    """The run finished as an uninterrupted one: its tracker at the last step, one metrics row per step,
    and its final weights bitwise `baseline`'s."""
    from conftest import assert_bitwise_equal, model_state, read_metrics  # (conftest imports this module)
    from relay import layout

    assert layout.read_tracker(run_dir) == steps, out[-5000:]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, steps + 1)), "each step once"
    assert_bitwise_equal(model_state(layout.step_dir(run_dir, steps)), baseline)


def wait_until(predicate, what: str, timeout: float = 300, dag_test=None):
    """Poll until predicate() is truthy (and return it). Fails naming `what`, with the DAG run's output
    when the background `airflow dags test` ended first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        if dag_test is not None and dag_test.proc.poll() is not None:
            raise AssertionError(f"the DAG run ended before {what}:\n{dag_test.log.read_text()[-5000:]}")
        time.sleep(0.05)
    tail = dag_test.log.read_text()[-5000:] if dag_test is not None else ""
    raise AssertionError(f"no {what} within {timeout}s\n{tail}")
