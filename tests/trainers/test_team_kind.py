"""A team's own trainer kind, defined only here (tests/support/team_kind: a distribution whose entry point
registers `line_fit` in the group relay.trainers), goes through `relay spec check`, `relay plan`, `relay train`
(two chunks, the second resumed from the first's checkpoint through Relay's gate) and `relay doctor` without a
change to Relay. Each command runs in a fresh interpreter, as a user's would, with the distribution on its path."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from relay.runs import layout
from relay.runs.metrics import MetricsLog
from support.helpers import DELETE, ROOT, spec_dict

TEAM = ROOT / "tests" / "support" / "team_kind"


def _relay(*args: str, team: bool = True) -> subprocess.CompletedProcess:
    path = [str(TEAM)] if team else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "relay", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_trainer_kind_registered_by_its_own_distribution_runs_through_relay_unchanged(tmp_path):
    d = spec_dict(
        name="line",
        checkpoint_dir=str(tmp_path / "ckpt"),
        **{"trainer": {"kind": "line_fit", "settings": {"batch_size": 8, "lr": 0.005}}, "s3": DELETE},
    )
    d["total_steps"], d["chunk_steps"] = 8, 4
    spec = tmp_path / "line.yaml"
    spec.write_text(yaml.safe_dump(d, sort_keys=False))

    unknown = _relay("spec", "check", str(spec), team=False)
    assert unknown.returncode != 0 and "unknown trainer kind 'line_fit'" in unknown.stderr + unknown.stdout
    assert "relay.trainers" in unknown.stderr + unknown.stdout, "the error says where a kind registers"

    checked = _relay("spec", "check", str(spec), "-v")
    assert checked.returncode == 0, checked.stderr
    assert "trainer line_fit" in checked.stdout and "trainer.settings.lr = 0.005" in checked.stdout

    plan = _relay("plan", str(spec))
    assert plan.returncode == 0, plan.stderr
    assert "chunk 2" in plan.stdout.lower() or "chunk_02" in plan.stdout, plan.stdout

    first = _relay("train", str(spec), "--to-step", "4", "--offline")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = _relay("train", str(spec), "--to-step", "8", "--offline")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumes from step 4" in second.stdout, second.stdout[-3000:]
    run_dir = tmp_path / "ckpt" / "line"
    assert layout.read_tracker(run_dir) == 8
    assert [r["step"] for r in MetricsLog(run_dir).rows()] == list(range(1, 9))

    doctor = _relay("doctor", str(spec), "--offline")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "a resume is safe" in doctor.stdout and "world size 1, FSDP2" in doctor.stdout
