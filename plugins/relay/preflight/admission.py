"""A step of a run admitted through the gate with what the run's spec says to check it against: the trainer's
smoke check, the settings fingerprint, whether the algorithm has a critic. The DAG's validate task calls it
in the Airflow worker or, with `validate_on: ray`, as a Ray job on the cluster (`python -m
relay.preflight.admission`), whose admission comes back on one marked line of its log.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from relay.checkpoints import certificate, commits
from relay.checkpoints.gate import Admission, admit_dir
from relay.checkpoints.validate import Skipped
from relay.runs import layout
from relay.runs.run import Run
from relay.spec.kinds import KINDS
from relay.spec.run_spec import spec_from_json


def smoke_check(spec):
    """The trainer's smoke check for this spec, if it has one and the spec asks for it."""
    if not spec.checkpoints.smoke:
        return None

    fn = KINDS[spec.trainer.kind].smoke_function()
    return None if fn is None else (lambda step_dir: fn(spec, step_dir))


def certify_check(spec):
    """The gate's offline certificate check for this spec: the trainer's, where the checkpoint has a certificate
    and the trainer an offline check; a skip that says why otherwise (the trainer checks it at resume)."""
    fn = KINDS[spec.trainer.kind].certify_function()

    def check(step_dir: Path) -> str:
        # a step whose commit record refuses it never gets here (relay.checkpoints.validate checks the record)
        m = layout.STEP_DIR.match(step_dir.name)
        standing = commits.standing(step_dir.parent, int(m.group(1)), step_dir) if m else None
        saved = certificate.read(step_dir)
        if saved is None:
            why = standing.detail if standing is not None else "saved without Relay"
            raise Skipped(f"no certificate ({why}): it resumes uncertified unless checkpoints.require_certificate")
        if fn is None:
            raise Skipped(f"{spec.trainer.kind} has no offline check; its trainer checks the certificate at resume")
        if not spec.checkpoints.smoke:
            raise Skipped("checkpoints.smoke is off: the gate loads no model; the trainer checks the certificate at resume")
        return fn(spec, step_dir, saved)

    return check


def admit(run: Run, step: int, *, expected_step: int | None = None) -> Admission:
    """Validate global_step_<step> of a run (with the trainer's smoke check)."""
    spec = run.spec
    return admit_dir(
        run.dir,
        step,
        expected_step=expected_step,
        smoke=smoke_check(spec),
        certify=certify_check(spec),
        run=run.name,
        fingerprint=spec.settings_fingerprint(),
        expect_critic=spec.core_settings.critic,
        incarnation=run.incarnation,
    )


# ------------------------------------------------------------------ as a Ray job (validate_on: ray)
ENV_VAR = "RELAY_GATE_REQUEST"
MARKER = "RELAY_ADMISSION "


def request_json(run: Run, step: int, expected_step: int | None) -> str:
    return json.dumps(
        {
            "spec": json.loads(run.spec.to_json()),
            "run": run.name,
            "incarnation": run.incarnation,
            "step": step,
            "expected_step": expected_step,
        }
    )


def main() -> int:
    """`python -m relay.preflight.admission`: admit a checkpoint where it lives; print the admission on one marked line."""

    req = json.loads(os.environ[ENV_VAR])
    spec = spec_from_json(json.dumps(req["spec"]))
    admission = admit(Run.of(spec, req["run"], req.get("incarnation")), req["step"], expected_step=req["expected_step"])
    print(admission.explain(), flush=True)
    print(MARKER + json.dumps(admission.to_dict()), flush=True)
    return 0


def parse_job_output(logs: str) -> dict | None:
    lines = [ln for ln in logs.splitlines() if ln.startswith(MARKER)]
    return json.loads(lines[-1][len(MARKER) :]) if lines else None


if __name__ == "__main__":
    raise SystemExit(main())
