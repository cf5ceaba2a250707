"""What a run did, as `relay report` and `relay audit` show it: the report (plots, chunk table, goodput,
fingerprints) of a run folder or of a run published in S3, and the replay audit of the steps trained twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relay.common.errors import UsageError
from relay.insights import report
from relay.insights.audit import AuditReport, audit
from relay.runs import layout
from relay.runs.metrics import readable_rows


def build_report(source: str, scratch: Path) -> tuple[Any, Path]:
    """The report of a run folder, or of s3://BUCKET/PREFIX/RUN (its files fetched into `scratch`), and the folder
    it is written to by default. A corrupt history is a finding, not a run with nothing in it."""
    if source.startswith("s3://"):
        rep = report.from_s3(source, scratch)
        return rep, Path(f"report-{rep.run}")
    for name in (layout.METRICS, layout.EVENTS):
        readable_rows(Path(source) / name)
    return report.build(Path(source)), report.default_out(Path(source))


def write_report(rep: Any, out: Path) -> dict[str, Path]:
    """Write the report's page and plot into `out`: their paths (html, png)."""
    return report.write(rep, out)


def replay_audit(run_dir: Path, tolerance: dict[str, float] | None = None) -> AuditReport:
    """Every step trained twice against its first try (and for verl's async trainer every prompt trained once);
    a folder with no metrics is a usage error, unreadable metrics a finding, never "nothing to compare"."""
    if not (run_dir / layout.METRICS).is_file():
        raise UsageError(
            f"{run_dir} has no {layout.METRICS}: not a run folder, or nothing trained yet",
            "give the run's folder, <checkpoint_dir>/<run>",
        )
    readable_rows(run_dir / layout.METRICS)
    return audit(run_dir, tolerance)
