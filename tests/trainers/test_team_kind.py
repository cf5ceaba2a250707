"""A team's own trainer kind, defined only here (tests/support/team_kind: a distribution whose entry point
registers `line_fit` in the group relay.trainers), goes through `relay spec check`, `relay plan`, `relay train`
(two chunks, the second resumed from the first's checkpoint through Relay's gate), `relay doctor` and the DAG's
Ray job for a chunk (a kill in it resumed bitwise) without a change to Relay. Each command runs in a fresh
interpreter, as a user's would, with the distribution on its path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from relay.runs import layout
from relay.runs.metrics import SUPERSEDED, MetricsLog, read_jsonl
from support.helpers import DELETE, ROOT, spec_dict

TEAM = ROOT / "tests" / "support" / "team_kind"


def _relay(*args: str, team: bool = True, python: bool = False) -> subprocess.CompletedProcess:
    """`python -m relay ARGS` (with `python`: `python ARGS`) in a fresh interpreter, the team's distribution on its
    path unless `team` is False."""
    path = [str(TEAM)] if team else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, *args] if python else [sys.executable, "-m", "relay", *args]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


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


@pytest.mark.services
@pytest.mark.fault
def test_a_team_kinds_chunk_runs_as_the_dags_ray_job_and_a_kill_in_it_resumes_bitwise(ray_address, tmp_path, fault_row):
    """The team's kind, on the cluster through ray.env_vars (its distribution on the job's PYTHONPATH, as a team that
    has not installed it on the nodes ships it): chunk 1 as the DAG's Ray job, chunk 2's job killed after step 6
    (the fault suite's kill point in Relay's session, which every kind's chunk goes through), and chunk 2 again,
    resumed from checkpoint 4: the run ends bitwise equal to the same kind trained straight in one process."""
    import torch

    def spec_at(folder, **ray_env: str):
        d = spec_dict(
            name="line",
            checkpoint_dir=str(folder / "ckpt"),
            **{"trainer": {"kind": "line_fit", "settings": {"batch_size": 8, "lr": 0.005}}, "s3": DELETE},
        )
        d["total_steps"], d["chunk_steps"] = 8, 4
        d["ray"]["env_vars"] = ray_env
        (folder / "line.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
        return folder / "line.yaml"

    (tmp_path / "straight").mkdir()
    straight = _relay("train", str(spec_at(tmp_path / "straight")), "--to-step", "8", "--offline")
    assert straight.returncode == 0, straight.stderr[-3000:]
    once = tmp_path / "killed-once"
    spec = spec_at(tmp_path, PYTHONPATH=str(TEAM), RELAY_FAULT_KILL_AT="after_step@6", RELAY_FAULT_ONCE=str(once))
    chunks = _relay(
        "-c",
        "import sys\n"
        "from relay.ops import connections, runs, train_run\n"
        f"run = runs.run_named({str(spec)!r}, None)\n"
        "for to in (4, 8, 8):\n"
        f"    state, _ = train_run.follow_job(connections.ray_jobs({ray_address!r}), run, to, offline=True)\n"
        "    print('CHUNK', to, state.status, train_run.job_outcome(run, state, to).code, flush=True)\n",
        python=True,
    )
    assert chunks.returncode == 0, chunks.stdout[-3000:] + chunks.stderr[-3000:]
    ends = [line.split()[1:] for line in chunks.stdout.splitlines() if line.startswith("CHUNK ")]
    assert [(to, status) for to, status, _ in ends] == [("4", "SUCCEEDED"), ("8", "FAILED"), ("8", "SUCCEEDED")], ends
    assert ends[1][2] != "0" and once.exists(), "chunk 2's first job was killed by the fault point"
    run_dir = tmp_path / "ckpt" / "line"
    assert layout.read_tracker(run_dir) == 8
    rows = MetricsLog(run_dir).rows()
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows] == [r["loss"] for r in MetricsLog(tmp_path / "straight" / "ckpt" / "line").rows()]
    weights = "global_step_8/actor/model_world_size_1_rank_0.pt"
    mine = torch.load(run_dir / weights, weights_only=True)
    theirs = torch.load(tmp_path / "straight" / "ckpt" / "line" / weights, weights_only=True)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), "bitwise equal"
    retrained = [r["step"] for r in read_jsonl(run_dir / SUPERSEDED)]
    assert retrained == [5, 6], "the killed job's steps after checkpoint 4, trained again"
    fault_row(
        case="team-kind-kill",
        layer="trainer (a team's own kind, as a Ray job)",
        fault="the trainer of a kind registered by a team's distribution is SIGKILLed after step 6, in chunk 2's Ray job",
        action="the job failed; the next job resumed from checkpoint 4 and the run ended bitwise equal to a straight one",
        steps_lost=len(retrained),
        run_dir=run_dir,
    )
