"""docs/FAULTS.md is generated from junit XML: rows come from the cases' `relay_fault` properties, each
with its real outcome; a fault case that failed before recording its row is listed as failed."""

import json
import sys

from support.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import faults_report

ROW = {
    "case": "trainer-kill",
    "fault": "trainer SIGKILLed | mid save",
    "action": "resumed",
    "cause": "preempted",
    "steps_lost": 2,
    "data_lost": "no",
    "layer": "trainer",
    "test_seed": 7,
}


def _junit(tmp_path, failed_case: bool):
    prop = json.dumps(ROW).replace('"', "&quot;")
    failing = (
        ('<testcase classname="tests.faults.test_x" name="test_b" time="1.0"><failure message="boom"/></testcase>')
        if failed_case
        else ""
    )
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        f'<testcase classname="tests.faults.test_x" name="test_a[mid_save@6]" time="2.5"><properties>'
        f'<property name="relay_fault" value="{prop}"/></properties></testcase>{failing}'
        '<testcase classname="tests.core.test_y" name="test_other" time="0.1"/>'
        "</testsuite></testsuites>"
    )
    return tmp_path / "j.xml"


def test_rows_come_from_the_results_with_their_outcome(tmp_path):
    out = tmp_path / "FAULTS.md"
    assert faults_report.main([str(_junit(tmp_path, failed_case=False)), "--out", str(out)]) == 0
    text = out.read_text()
    assert (
        "trainer SIGKILLed \\| mid save | resumed | preempted | 2 | no | trainer | "
        "`tests/faults/test_x.py::test_a[mid_save@6]` | passed |" in text
    )
    assert "**1 cases: 1 passed, 0 not passed. Data lost: none.**" in text and "RELAY_TEST_SEED=7" in text
    assert "test_other" not in text and "## Not covered by this suite yet" in text


def test_a_failed_fault_case_shows_as_failed_and_fails_the_command(tmp_path):
    out = tmp_path / "FAULTS.md"
    assert faults_report.main([str(_junit(tmp_path, failed_case=True)), "--out", str(out)]) == 1
    assert "| test_b | the case recorded no row (it failed before the end) | ? | ? | ? |" in out.read_text()
    assert "| failed |" in out.read_text()
