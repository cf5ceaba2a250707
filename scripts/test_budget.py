"""What a test run cost, from its junit results: the suite's wall time and its slowest tests.

    .venv/bin/python scripts/test_budget.py JUNIT.xml [--wall SECONDS] [--top 15] [--budget MINUTES]

scripts/test.sh prints it at the end of every run that writes junit results (CI's among them), so each landing
shows where its minutes went. A test's time is pytest's `total`: its setup (a module's shared DAG run or Airflow
stack is paid by the module's first test), its call and its teardown. The files' sums show which module to
shrink: loadfile hands a whole file to one worker, so a file's sum is also the least the suite can take.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def tests(path: Path) -> list[tuple[str, float, str]]:
    """(test id, seconds with setup and teardown, outcome) of each test case in a junit file."""
    out = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        classname, name = tc.get("classname", ""), tc.get("name", "")
        test = f"{classname.replace('.', '/')}.py::{name}" if classname else name
        if tc.find("failure") is not None or tc.find("error") is not None:
            outcome = "failed"
        elif tc.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        out.append((test, float(tc.get("time") or 0), outcome))
    return out


def clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 60}:{s % 60:02d}"


def report(rows: list[tuple[str, float, str]], wall: int | None, top: int, budget: float | None) -> str:
    total = sum(t for _, t, _ in rows)
    by_file: dict[str, float] = defaultdict(float)
    for test, t, _ in rows:
        by_file[test.split("::", 1)[0]] += t
    failed = sum(o == "failed" for _, _, o in rows)
    head = f"[budget] {len(rows)} tests ({failed} failed)" + (f" in {clock(wall)} wall" if wall is not None else "")
    lines = [head + f"; {clock(total)} of test time summed over the workers"]
    if budget is not None and wall is not None:
        lines[0] += f"; budget {budget:g} min: {'within' if wall <= budget * 60 else 'OVER'}"
    lines.append(f"[budget] the {top} slowest tests (setup and teardown included):")
    for test, t, outcome in sorted(rows, key=lambda r: -r[1])[:top]:
        lines.append(f"  {clock(t):>6}  {test}" + ("" if outcome == "passed" else f"  ({outcome})"))
    lines.append("[budget] the slowest files (their tests' sum):")
    for path, t in sorted(by_file.items(), key=lambda kv: -kv[1])[:5]:
        lines.append(f"  {clock(t):>6}  {path}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", nargs="+", type=Path)
    p.add_argument("--wall", type=int, help="the run's wall time in seconds (scripts/test.sh measures it)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--budget", type=float, help="minutes the run should take; said beside the wall time")
    args = p.parse_args(argv)
    rows = [r for path in args.junit if path.is_file() for r in tests(path)]
    if not rows:
        print(f"[budget] no test results in {', '.join(map(str, args.junit))}", file=sys.stderr)
        return 2
    print(report(rows, args.wall, args.top, args.budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
