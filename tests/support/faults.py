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

from support.helpers import ROOT

PROPERTY = "relay_fault"


@pytest.fixture
def fault_row(record_property):
    """record(case, fault, action, steps_lost, run_dir=..., store=None, layer="trainer"): this case's row of
    docs/FAULTS.md. `case` is the fault's id in scripts/faults_report.py's PLANNED list (trainer-kill,
    s3-errors, new-worker-host, ray-orphan...). Its "data lost" is measured: data_lost(run_dir, store).
    Call it last, once the case's assertions have passed."""

    def record(
        case: str,
        fault: str,
        action: str,
        steps_lost: int | str,
        *,
        run_dir: Path,
        store=None,
        layer: str = "trainer",
        driver: tuple[int, str] | None = None,
        **extra,
    ) -> None:
        record_property(
            PROPERTY,
            json.dumps(
                {
                    "case": case,
                    "fault": fault,
                    "action": action,
                    "steps_lost": steps_lost,
                    "data_lost": data_lost(run_dir, store),
                    "cause": classified(run_dir, driver),
                    "layer": layer,
                    **extra,
                },
                sort_keys=True,
            ),
        )

    return record


def classified(run_dir: Path, driver: tuple[int, str] | None = None) -> str:
    """The cause Relay gave each attempt the fault ended (relay.runs.failure_cause, through the goodput ledger's
    failures: a chunk_failed event's cause, or a graceful stop's). An attempt ended with nothing left to classify
    it, a `relay train` process killed in-process, is classified from `driver` (its exit code and log) as Relay
    classifies a Ray job's driver that ended so. "none" when no attempt failed (the fault was absorbed: a
    quarantine and fallback at a resume, a publish retried, an adopted job)."""
    from relay.insights import goodput
    from relay.runs import failure_cause

    ledger = goodput.ledger(run_dir)
    causes = []
    for f in ledger.failures if ledger is not None else []:
        cause = f.cause
        if cause == "unknown" and driver is not None:
            cause = failure_cause.classify("FAILED", "", driver[1], driver[0]).cause
        causes.append(cause)
    return ", ".join(dict.fromkeys(causes)) or "none (no attempt failed)"


def data_lost(run_dir: Path, store=None) -> str:
    """What of a run's data is gone, measured in its folder and S3: "no", or "yes: ..." naming it.

    The run's data: one metrics row for every step up to its tracker (steps trained again after a resume
    keep their first rows in metrics.superseded.jsonl); every checkpoint a trainer committed or a restore
    brought (events.jsonl), unless retention deleted it on purpose or a newer published checkpoint covers it
    (a mid-chunk save that lived only on a host that is gone), still whole in the folder (structure and
    integrity), published in S3, or set aside by a check (.relay/quarantine, .relay/superseded); and the
    frozen data copies the run record names, in the folder or in S3."""
    import re

    from relay.checkpoints.validate import validate_checkpoint
    from relay.runs import layout
    from relay.runs.metrics import read_events, read_jsonl
    from relay.runs.record import read_record

    run_dir = Path(run_dir)
    run = run_dir.name
    missing = []
    tracker = layout.read_tracker(run_dir) or 0
    rows = {r.get("step") for r in read_jsonl(run_dir / layout.METRICS)}
    if gaps := [s for s in range(1, tracker + 1) if s not in rows]:
        missing.append(f"metrics rows of steps {gaps[:5]}")
    events = read_events(run_dir)
    committed = {e["step"] for e in events if e["event"] in ("checkpoint", "restore")}
    retired = {s for e in events if e["event"] == "retention" for s in e.get("deleted") or ()}
    published = {m.step for m in store.published(run)} if store is not None else set()
    aside = {
        int(m.group(1))
        for corner in ("quarantine", "superseded")
        for p in (layout.relay_dir(run_dir, corner).iterdir() if layout.relay_dir(run_dir, corner).is_dir() else ())
        if (m := re.match(r"global_step_(\d+)\.", p.name))
    }
    covered = {s for s in committed if any(p > s for p in published)}
    for step in sorted(committed - retired - published - aside - covered):
        if not (layout.step_dir(run_dir, step).is_dir() and validate_checkpoint(run_dir, step, upto="integrity").ok):
            missing.append(f"checkpoint step {step}")
    for f in (read_record(run_dir).get("data") or {}).get("files", []):
        here = (run_dir / "data" / f"{f['sha256']}.parquet").is_file()
        if not here and not (store is not None and store.head(store.run_key(run, "data", f"{f['sha256']}.parquet"))):
            missing.append(f"frozen copy {f['sha256'][:12]}")
    return "yes: " + "; ".join(missing) + " (found neither in the run folder nor in S3)" if missing else "no"


class ForkServer:
    """A client of tests/support/forkserver.py: `relay train` children forked from one warm process (or, with
    mode "airflow" and an Airflow home's environment `env`, `airflow ...` children)."""

    def __init__(self, mode: str = "relay", env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "support" / "forkserver.py"), mode],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env if env is not None else {**os.environ, "PYTHONWARNINGS": "ignore"},
        )

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died (exit {self.proc.poll()})")
        return json.loads(line)

    def start(
        self,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        err: Path | None = None,
        whole_env: bool = False,
        cwd: Path | None = None,
    ) -> int:
        """A child running `relay <argv>`: stdout (and stderr, unless `err`) to `log`; `env` added to the
        server's environment, or with whole_env the child's whole environment; in `cwd` (else the repo root)."""
        req = {
            "argv": argv,
            "env": env or {},
            "log": str(log),
            "whole_env": whole_env,
            **({"err": str(err)} if err else {}),
            **({"cwd": str(cwd)} if cwd else {}),
        }
        return self._ask(req)["pid"]

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
    from relay.runs import layout
    from support.helpers import assert_bitwise_equal, model_state, read_metrics  # (conftest imports this module)

    assert layout.read_tracker(run_dir) == steps, out[-5000:]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, steps + 1)), "each step once"
    assert_bitwise_equal(model_state(layout.step_dir(run_dir, steps)), baseline)
