"""The gate a chunk's checkpoint passes before anything trusts it: validate every level; record a
manifest when it is whole; otherwise quarantine it, fall back to the newest valid checkpoint, and
say so. Shared by the DAG's validate task, `python -m relay checkpoint validate` and Ray jobs.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from relay.checkpoints import manifest, swap
from relay.checkpoints.resume import find_resume_point, quarantine
from relay.checkpoints.validate import CheckReport, validate_checkpoint, write_manifest
from relay.common.errors import CheckpointError
from relay.runs import layout
from relay.runs.kinds import KINDS
from relay.runs.metrics import record_event
from relay.runs.run import Run
from relay.runs.spec import spec_from_json


@dataclass
class Admission:
    report: CheckReport
    manifest: manifest.Manifest | None = None
    quarantined_to: str | None = None
    fell_back_to: int | None = None  # the step the tracker names after a quarantine (None: nothing valid)

    @property
    def ok(self) -> bool:
        return self.report.ok

    def to_dict(self) -> dict:
        return {**self.report.to_dict(), "quarantined_to": self.quarantined_to, "fell_back_to": self.fell_back_to,
                "manifest": self.manifest and f"{self.report.path}/{manifest.NAME}"}

    def explain(self) -> str:
        if self.ok:
            return self.report.summary()
        fb = (f"the tracker now names step {self.fell_back_to}, the next resume starts there"
              if self.fell_back_to else "no valid checkpoint is left locally")
        return (f"{self.report.summary()}\nquarantined to {self.quarantined_to} (never deleted, never published); "
                f"{fb}")


def smoke_check(spec):
    """The trainer's smoke check for this spec, if it has one and the spec asks for it."""
    if not spec.checkpoints.smoke:
        return None

    fn = KINDS[spec.trainer.kind].smoke_function()
    return None if fn is None else (lambda step_dir: fn(spec, step_dir))


def admit(run: Run, step: int, *, expected_step: int | None = None) -> Admission:
    """Validate global_step_<step> of a run (with the trainer's smoke check)."""
    spec = run.spec
    return admit_dir(run.dir, step, expected_step=expected_step, smoke=smoke_check(spec), run=run.name,
                     fingerprint=spec.settings_fingerprint(), expect_critic=spec.settings.has_critic)


def admit_dir(run_dir: Path, step: int | None = None, *, expected_step: int | None = None, smoke=None,
              run: str | None = None, fingerprint: str | None = None,
              expect_critic: bool | None = None) -> Admission:
    """Validate a checkpoint (default: the tracker's); write its manifest, or quarantine it and fall back."""
    run_dir = Path(run_dir)
    t0 = time.time()
    if run_dir.is_dir() and (done := swap.recover(run_dir)):  # a reshard killed mid-swap
        print(f"[relay] {done}", flush=True)
    report = validate_checkpoint(run_dir, step, expected_step=expected_step, smoke=smoke,
                                 expect_critic=expect_critic)
    if report.step is not None and run_dir.is_dir():  # what the gate costs a chunk (relay.runs.save_interval)
        record_event(run_dir, "validation", step=report.step, ok=report.ok, seconds=round(time.time() - t0, 3))
    if report.ok:
        assert report.step is not None  # a valid report names the step it validated
        step_dir = layout.step_dir(run_dir, report.step)
        return Admission(report, manifest.read(step_dir) or write_manifest(report, run or run_dir.name, fingerprint))
    if report.step is None or not layout.step_dir(run_dir, report.step).is_dir():
        return Admission(report)  # nothing there to quarantine (a missing folder, a garbage tracker)
    dest = quarantine(run_dir, report)
    try:
        fell_back = find_resume_point(run_dir).step or None
    except CheckpointError:
        fell_back = None
    return Admission(report, quarantined_to=str(dest), fell_back_to=fell_back)


# ------------------------------------------------------------------ as a Ray job (validate_on: ray)
ENV_VAR = "RELAY_GATE_REQUEST"
MARKER = "RELAY_ADMISSION "


def request_json(run: Run, step: int, expected_step: int | None) -> str:
    return json.dumps({"spec": json.loads(run.spec.to_json()), "run": run.name, "step": step,
                       "expected_step": expected_step})


def main() -> int:
    """`python -m relay.checkpoints.gate`: admit a checkpoint where it lives; print the admission on one marked line."""

    req = json.loads(os.environ[ENV_VAR])
    spec = spec_from_json(json.dumps(req["spec"]))
    admission = admit(Run.of(spec, req["run"]), req["step"], expected_step=req["expected_step"])
    print(admission.explain(), flush=True)
    print(MARKER + json.dumps(admission.to_dict()), flush=True)
    return 0


def parse_job_output(logs: str) -> dict | None:
    lines = [ln for ln in logs.splitlines() if ln.startswith(MARKER)]
    return json.loads(lines[-1][len(MARKER):]) if lines else None


if __name__ == "__main__":
    raise SystemExit(main())
