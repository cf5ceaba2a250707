"""What a run did, as `relay report` and `relay audit` show it: the report (plots, chunk table, goodput,
fingerprints) of a run folder or of a run published in S3, and the replay audit of the steps trained twice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.common.errors import UsageError
from relay.insights import goodput, report
from relay.insights.audit import AuditReport, audit
from relay.preflight.prepare import RunState, run_state
from relay.runs import layout
from relay.runs.metrics import read_events, readable_rows
from relay.runs.run import Run


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


def publish_report(run: Run, store: Any) -> dict[str, str]:
    """The run's report written beside the run and, with a store, put in S3 beside its checkpoints with the run's
    metrics, events and record (what a report from S3 is rebuilt from): the local paths, the URIs, its summary."""
    return report.publish(run, store)


def report_page(run: Run, store: Any, back: str | None = None) -> str:
    """The run's report page as it is now, from its folder where this process sees it, else from S3 (the Airflow
    UI's "Run report" link); `back`: the page it links back to."""
    return report.current_html(run, store, back=back)


@dataclass
class Finished:
    """A run at its end: its state, how many chunks resumed from a checkpoint, and what its time went to."""

    state: RunState
    resumes: int
    goodput: str


def finished(run: Run) -> Finished:
    """What a run's last task says of it: its state, its resumes, its goodput ledger in one line."""
    resumes = [e for e in read_events(run.dir) if e["event"] == "chunk_start" and e["resumed_from"]]
    spent = goodput.ledger(run.dir)
    summary = spent.describe() if spent is not None else "goodput: no chunk attempt recorded"
    return Finished(run_state(run), len(resumes), summary)
