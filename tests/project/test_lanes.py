"""The test lanes (docs/development.md): what CI runs and what it leaves to a lane, the kill matrix's sample, and the
budget every test run ends with."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from relay.common.faultpoint import FAULT_PHASES
from support import kill_matrix
from support.helpers import ROOT


def test_every_seed_draws_every_phase_and_both_handoffs_and_every_case_can_be_drawn():
    drawn = set()
    for rng_seed in range(400):
        cases = kill_matrix.sample(rng_seed)
        assert sorted(c[0] for c in cases) == sorted(FAULT_PHASES), rng_seed
        assert {c[2] for c in cases} == {False, True}, f"seed {rng_seed}: both handoffs"
        assert cases == kill_matrix.sample(rng_seed), "a seed draws the same cases again"
        drawn |= set(cases)
    every = kill_matrix.matrix()
    assert drawn == set(every), f"never drawn: {sorted(set(every) - drawn)}"
    assert len(every) == len(set(every)) == 48
    assert all(step > kill_matrix.CHUNK for _, step, warm in every if warm), "a warm case lands in the warm chunk"


def test_a_case_is_named_by_its_id_and_an_unknown_id_is_refused_naming_the_cases(monkeypatch):
    monkeypatch.setenv("RELAY_KILL_POINTS", "after_step@9-warm, before_rename@6")
    assert kill_matrix.chosen(False, 0) == [("before_rename", 6, False), ("after_step", 9, True)]
    monkeypatch.setenv("RELAY_KILL_POINTS", "after_step@3-warm")  # step 3 is in chunk 1, which starts cold
    with pytest.raises(pytest.UsageError, match=r"no case after_step@3-warm; the cases are .*after_tracker@12-warm"):
        kill_matrix.chosen(False, 0)
    monkeypatch.delenv("RELAY_KILL_POINTS")
    assert kill_matrix.chosen(True, 0) == kill_matrix.ordered(kill_matrix.matrix())


def test_the_budget_shows_the_wall_time_and_the_slowest_tests_with_their_setup(tmp_path):
    suite = ET.Element("testsuite")
    for name, seconds in (("test_a", 3.0), ("test_b", 700.5), ("test_c", 65.0)):
        ET.SubElement(suite, "testcase", classname="tests.airflow.test_x", name=name, time=str(seconds))
    failed = ET.SubElement(suite, "testcase", classname="tests.spec.test_y", name="test_d", time="1.0")
    ET.SubElement(failed, "failure", message="boom")
    junit = tmp_path / "junit.xml"
    ET.ElementTree(suite).write(junit)
    r = subprocess.run(
        [sys.executable, "scripts/test_budget.py", str(junit), "--wall", "1900", "--top", "2", "--budget", "30"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert (
        lines[0]
        == "[budget] 4 tests (1 failed) in 31:40 wall; 12:50 of test time summed over the workers; budget 30 min: OVER"
    )
    assert lines[2:4] == ["   11:40  tests/airflow/test_x.py::test_b", "    1:05  tests/airflow/test_x.py::test_c"]
    assert "   12:48  tests/airflow/test_x.py" in lines
    empty = subprocess.run(
        [sys.executable, "scripts/test_budget.py", str(tmp_path / "none.xml")], cwd=ROOT, capture_output=True, text=True
    )
    assert empty.returncode == 2 and "no test results" in empty.stderr


def collected(lane: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RELAY_TEST_LANE", "RELAY_KILL_POINTS")}
    if lane:
        env["RELAY_TEST_LANE"] = lane
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [line for line in r.stdout.splitlines() if "::" in line]


@pytest.mark.processes  # three collections of the whole suite, each in a fresh interpreter
def test_ci_leaves_each_lanes_tests_to_its_lane_and_the_faults_lane_runs_every_fault_case():
    ci, verl, faults = collected(None), collected("verl"), collected("faults")
    assert not set(ci) & set(verl), "a verl lane test in CI"
    assert "tests/airflow/test_verl_dag.py::test_every_verl_resume_is_certified_by_verls_own_workers" in ci
    assert any(t.startswith("tests/airflow/test_verl_async_dag.py::") for t in verl)
    lane_files = (
        "tests/trainers/test_verl_",
        "tests/airflow/test_verl_async_dag.py",
        "tests/airflow/test_verl_elastic_dag.py",
        "tests/airflow/test_verl_lossless_dag.py",
    )
    assert all(t.startswith(lane_files) for t in verl), verl
    in_lane_only = [t for t in faults if t not in ci]
    assert "tests/e2e/test_celery.py::test_a_run_on_celery_workers_survives_a_worker_killed_during_a_validation" in (
        in_lane_only
    )
    kills = [t for t in faults if t.startswith("tests/faults/test_kill_points.py::")]
    assert len(kills) == len(kill_matrix.matrix()), "the faults lane tries the whole kill matrix"
    assert len([t for t in ci if t.startswith("tests/faults/test_kill_points.py::")]) == len(FAULT_PHASES)
    assert "tests/airflow/test_run_dag.py::test_killed_chunk_job_is_retried_and_resumes_bitwise" in faults, (
        "CI's fault cases are in the faults lane too: docs/FAULTS.md is the whole matrix"
    )
