"""The checks before any GPU time is spent, cheap ones first; one implementation for the DAG's
preflight tasks, the per-chunk checks of the train task, and the CLI.

    settings  the resume-critical settings against the run's recorded ones (no file read)
    data      first chunk: quality-check the sources, freeze them, record the settings snapshot;
              later: compare each source with its frozen fingerprint (data.on_source_change)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from relay.common import files
from relay.common.errors import RelayError
from relay.common.redaction import redact
from relay.data import freeze as frozen
from relay.data import quality
from relay.data.fingerprint import sha256_file
from relay.preflight import guard
from relay.runs import layout
from relay.runs.metrics import record_event
from relay.runs.record import RECORD, read_record
from relay.runs.run import Run


@dataclass
class DataState:
    frozen: list[dict]
    froze_now: bool = False
    quality: list[str] = field(default_factory=list)  # report summaries
    source_changes: list[str] = field(default_factory=list)  # tolerated (use_frozen) changes


def check_settings(run: Run, *, allow_drift=(), by: str = "", dag_run: str = "") -> list[str]:
    """Raise DriftError on unallowed drift; return the allowed changes (recorded). Blank entries (the
    trigger form's text box sends one per empty line) are ignored."""
    keys = [k.strip() for k in allow_drift or () if isinstance(k, str) and k.strip()]
    return [str(c) for c in guard.check(run, allow_drift=keys, by=by, dag_run=dag_run)]


def check_quality(spec, files: list[str]) -> list[quality.QualityReport]:
    extra = [e for path in spec.data.expectations for e in quality.load_expectations(path)]
    return [quality.check(f, min_rows=spec.core_settings.batch_rows, extra=extra) for f in files]


def prepare_data(run: Run, *, store=None, by: str = "") -> DataState:
    """Freeze the data at the run's first chunk (after its quality checks); later, guard the sources."""
    spec, run_dir = run.spec, run.dir
    files = frozen.frozen_files(run_dir)
    if files is not None:
        changes = frozen.check_sources(run)  # raises under on_source_change: fail
        for c in changes:
            record_event(run_dir, "source_drift", policy=spec.data.on_source_change, detail=c.summary())
        return DataState([f.to_dict() for f in files], source_changes=[c.summary() for c in changes])
    reports = check_quality(spec, spec.data.train_files)
    summaries = [r.summary() for r in reports]
    failed = [r for r in reports if not r.ok]
    for r in reports:
        _keep_report(run, r, store)
    if failed:
        raise quality.DataQualityError(
            "data quality checks failed; nothing was frozen and no chunk ran:\n" + "\n".join(r.summary() for r in failed),
            "fix the rows named above in the source files (or the expectations), then trigger again",
            failed,
        )
    files = frozen.freeze(run, store, quality={r.file: r.ok for r in reports})
    guard.record(run, by=by)
    publish_record(run, store)
    record_event(run_dir, "freeze", files=[{"source": f.source, "sha256": f.sha256, "rows": f.rows} for f in files])
    return DataState([f.to_dict() for f in files], froze_now=True, quality=summaries)


def publish_record(run: Run, store) -> None:
    """Keep the run record (frozen data, settings snapshot, drift decisions) beside the run in S3."""
    if store is not None:
        with store.fenced(run.folder, "publishing the run record") as w:  # an old DAG run's never replaces a new one's
            w.put_json(store.run_key(run.name, RECORD), read_record(run.dir))


def _keep_report(run: Run, report: quality.QualityReport, store) -> None:
    """Keep a quality report with the run: in its folder, and in S3 beside the checkpoints."""
    name = f"quality-{sha256_file(report.file)[0][:16]}.json"
    text = redact(report.to_json())  # observed values are the data's own: a registered secret among them is not kept
    files.atomic_write(layout.relay_dir(run.dir, "data", name), text.encode())
    if store is not None:
        store.put_json(store.run_key(run.name, "data", name), json.loads(text))


def before_chunk(run: Run, *, allow_drift=(), by: str = "", dag_run: str = "") -> dict:
    """What every chunk re-checks just before its job: settings drift and the data sources."""
    allowed = check_settings(run, allow_drift=allow_drift, by=by, dag_run=dag_run)
    try:
        changes = frozen.check_sources(run)  # nothing before the freeze
    except frozen.SourceDriftError as e:
        raise _with_quality(run.spec, e) from None
    return {"allowed_drift": allowed, "source_changes": [c.summary() for c in changes]}


def _with_quality(spec, e: frozen.SourceDriftError) -> frozen.SourceDriftError:
    """A changed source that also fails the data-quality suite says so: "1 row(s) changed" alone does not
    tell a null ground_truth or a duplicated index from an edited prompt."""
    changed = [str(c.file.source) for c in e.changes if c.diff is not None]
    try:
        bad = [r for r in check_quality(spec, changed) if not r.ok]
    except RelayError:  # the suite itself failed: the change alone is reported, as before
        return e
    if not bad:
        return e
    return frozen.SourceDriftError(
        e.what + "\nthe changed source also fails the data-quality suite:\n" + "\n".join(r.summary() for r in bad),
        e.fix,
        e.changes,
    )
