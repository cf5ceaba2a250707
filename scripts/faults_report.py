"""docs/FAULTS.md from the fault suite's test results, never by hand.

    .venv/bin/python scripts/faults_report.py JUNIT.xml [JUNIT2.xml ...] [--out docs/FAULTS.md]

Reads pytest junit XML (written with -o junit_family=xunit1, which keeps each case's properties; see
scripts/test.sh). Each fault case records its row through the `fault_row` fixture
(tests/support/faults.py) as a `relay_fault` property: the fault, what Relay did, the steps lost,
whether data was lost. A case under tests/faults/ that failed before recording its row is listed
too, as failed: the table shows every case's real outcome. Exit 1 when a case failed or lost data.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
from relay.common.faultpoint import FAULT_PHASES as PHASES

PROPERTY = "relay_fault"
# The fault cases the suite covers; a case id not yet in the results is listed as "not covered yet".
PLANNED = {
    "trainer-kill": "trainer SIGKILLed at every phase of a step and of a checkpoint's write",
    "ray-orphan": "Ray head dies, a trainer lives on as an orphan (fenced by the lease)",
    "ray-head-restart": "Ray head dies mid-chunk and comes back",
    "scheduler-kill": "Airflow scheduler and triggerer killed and restarted mid-chunk",
    "triggerer-down": "the triggerer down while a chunk's job trains past the chunk's timeout",
    "celery-worker-kill": "a Celery worker SIGKILLed during a chunk's validate task",
    "task-cleared": "a person clears a deferred train task while its job trains well",
    "task-process-kill": "the train task's process SIGKILLed between its job's submission and its deferral",
    "job-frozen": "a chunk's trainer frozen (SIGSTOP): alive, no new step",
    "warm-chunk-kill": "a trainer killed in a chunk its job started warm (chunks.handoff: warm)",
    "team-kind-kill": "a team's own trainer kind (registered by entry point) killed in its chunk's Ray job",
    "warm-gate-refusal": "the checkpoint a warm chunk went on from fails the gate while the job trains ahead",
    "graceful-stop": "a trainer SIGTERMed mid-chunk (a pod's end, a spot notice, `ray job stop`)",
    "s3-stopped": "S3 server stopped during a publish, restarted later",
    "s3-errors": "S3 returns 500 and 503 (slow down) for a while",
    "disk-full": "the checkpoint disk fills during a save",
    "new-worker-host": "the next chunk lands on a new host with an empty checkpoint dir",
    "corruption": "a checkpoint folder corrupted in each way of the checkpoint issue",
    "data-change": "the training data changes in each way of the data issue",
    "fresh-start-old-tasks": "a fresh start while an old DAG run's validate and publish tasks are queued",
    "dag-run-cleared": "a DAG run cleared after a newer incarnation began",
    "fresh-start-interrupted": "a fresh start killed between its S3 archive and its local move, then resumed",
    "restore-during-marks": "a restore of the run's history while the train task writes its phase marks",
    "publish-across-fresh-start": "a publication in flight while a fresh start moves the run's S3 prefix aside",
    "seam-stress": "an old DAG run's writers at seeded points around a fresh start, many rounds",
    "warm-job-dag-run-failed": "a DAG run marked failed while its job trains the next chunk ahead of its admission",
    "warm-job-validation-error": "a validation that errors while the chunk's job trains the next chunk ahead",
    "warm-job-failed-waiting": "a DAG run marked failed while its warm job waits for its admission",
    "warm-job-killed-waiting": "a warm job killed while it waits for its admission",
    "node-lost": "a Ray worker node lost (its raylet and processes killed) under an elastic run, then started again",
    "node-lost-elastic-dag": "a Ray worker node lost mid-chunk under an elastic verl run's DAG, started again later",
    "async-lossless-kill": "a lossless separate_async verl job SIGKILLed mid-chunk, its rollout generating ahead",
}


def cases(paths: list[Path]) -> list[dict]:
    out = []
    for path in paths:
        for tc in ET.parse(path).getroot().iter("testcase"):
            classname, name = tc.get("classname", ""), tc.get("name", "")
            test = f"{classname.replace('.', '/')}.py::{name}" if classname else name
            if tc.find("failure") is not None or tc.find("error") is not None:
                outcome = "failed"
            elif tc.find("skipped") is not None:
                outcome = "skipped"
            else:
                outcome = "passed"
            rows = [json.loads(p.get("value")) for p in tc.iter("property") if p.get("name") == PROPERTY]
            in_suite = classname.startswith("tests.faults.") or test.startswith("tests/faults/")
            if not rows and not (in_suite and outcome == "failed"):
                continue  # not a fault case (or a helper test of the suite that passed)
            for row in rows or [
                {
                    "fault": name,
                    "action": "the case recorded no row (it failed before the end)",
                    "cause": "?",
                    "steps_lost": "?",
                    "data_lost": "?",
                }
            ]:
                out.append({**row, "test": test, "outcome": outcome, "seconds": float(tc.get("time") or 0)})
    return out


def render(rows: list[dict], sources: list[Path], wall: int | None = None, workers: int | None = None) -> str:
    passed = sum(r["outcome"] == "passed" for r in rows)
    lost = [r for r in rows if str(r.get("data_lost")) != "no"]
    seeds = sorted({str(r["test_seed"]) for r in rows if "test_seed" in r})
    covered = {r.get("case") for r in rows if r["outcome"] == "passed"}
    lines = [
        "# Faults: what Relay does when things break",
        "",
        "Generated by `scripts/faults_report.py` from the fault suite's test results "
        f"({', '.join(p.name for p in sources)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); "
        "do not edit by hand: run `./scripts/test.sh --faults` (the faults lane) to regenerate it.",
        "",
        f"**{len(rows)} cases: {passed} passed, {len(rows) - passed} not passed. Data lost: "
        f"{'none' if not lost else f'{len(lost)} cases (see below)'}.**"
        + (f" Kill points drawn with RELAY_TEST_SEED={', '.join(seeds)}." if seeds else "")
        + (
            f" The suite ran in {wall // 60} min {wall % 60:02d} s (install and services included) on {workers} "
            "pytest workers."
            if wall is not None
            else ""
        ),
        "",
        "Each case asserts that the run finishes, that its final weights are bitwise those of an "
        "uninterrupted run with the same seed (an elastic run across world sizes: the same data order, LR and batch; "
        "a lossless async run: every prompt trained once within its staleness bound, by `relay audit`), and that "
        "the steps lost are at most the steps since the last valid checkpoint. *Steps lost*: steps trained before "
        "the fault and trained again after it. *Cause as "
        "classified*: what Relay's failure classification (relay.runs.failure_cause) named each attempt the fault "
        "ended; none when no attempt failed. *Data lost*: a step's metrics row, a committed checkpoint that no "
        "newer published one covers, or a frozen data copy, found neither in the run's folder nor in S3.",
        "",
        "| fault | what Relay did | cause as classified | steps lost | data lost | layer | test | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    for r in rows:
        lines.append(
            f"| {esc(r['fault'])} | {esc(r['action'])} | {esc(r.get('cause', '?'))} | "
            f"{esc(r['steps_lost'])} | {esc(r['data_lost'])} | {esc(r.get('layer', 'trainer'))} | "
            f"`{esc(r['test'])}` | {r['outcome']} |"
        )
    missing = [f"- {what} (`{case}`)" for case, what in PLANNED.items() if case not in covered]
    if missing:
        lines += ["", "## Not covered by this suite yet", "", *missing]
    return "\n".join(lines) + "\n"


def ordered(rows: list[dict]) -> list[dict]:
    """By case, in the issue's order, then by test (kill points by step, then phase, as they were drawn)."""
    import re

    order = list(PLANNED)

    def key(r):
        m = re.search(r"\[(\w+)@(\d+)(-warm)?\]", r["test"])
        point = (int(m.group(2)), PHASES.index(m.group(1)) if m.group(1) in PHASES else 99) if m else (0, 0)
        return (order.index(r["case"]) if r.get("case") in order else len(order), point, r["test"])

    return sorted(rows, key=key)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "FAULTS.md")
    p.add_argument("--wall", type=int, help="the suite's wall time in seconds (scripts/test.sh measures it)")
    p.add_argument("--workers", type=int, help="pytest workers it ran on")
    args = p.parse_args(argv)
    rows = ordered(cases(args.junit))
    if not rows:
        print(f"no fault cases in {', '.join(map(str, args.junit))}", file=sys.stderr)
        return 2
    args.out.write_text(render(rows, args.junit, args.wall, args.workers))
    bad = [r for r in rows if r["outcome"] != "passed" or str(r.get("data_lost")) != "no"]
    seeds = sorted({str(r["test_seed"]) for r in rows if "test_seed" in r})
    print(
        f"{args.out}: {len(rows)} cases, {len(rows) - len(bad)} passed with no data lost"
        + (f"; kill points drawn with RELAY_TEST_SEED={', '.join(seeds)} (set it to draw them again)" if seeds else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
