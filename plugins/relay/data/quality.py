"""Data-quality checks with great-expectations 1.x for verl's RL parquet schema.

great-expectations cannot address nested struct fields (reward_model.ground_truth,
extra_info.index): it reports them as missing columns, so valid data would fail. The table is
flattened with pyarrow first (struct fields become `parent.child` columns), and the prompt, a chat
list of {role, content} or a string, is summarised into a `prompt.valid` column the suite checks.

A missing required column is bad data (a column renamed, say). An exception inside
great-expectations is a Relay error, never reported as bad data.

A pass is remembered by content: the file's sha256, the suite's expectations and the versions of
great-expectations and of this check (~/.cache/relay/data-checks/, or $RELAY_DATA_CHECK_CACHE; "off" turns
it off). The same bytes against the same suite pass again without great-expectations being imported (3 s
of CPU per check on the 2-core machine) or run; a changed byte, expectation or version checks anew, and a
failure is never remembered.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from relay.common.errors import RelayError
from relay.common.files import atomic_write
from relay.data.fingerprint import DataError, sha256_file

if TYPE_CHECKING:
    import pandas as pd

CHECK_VERSION = 1  # bump when flatten() or the way results are read changes: remembered passes no longer count
REQUIRED = ("data_source", "prompt", "reward_model.ground_truth", "extra_info.index")
EXAMPLES = 5
Expectation = tuple[str, dict[str, Any], str]  # (great-expectations type, its arguments, what it means)


class DataQualityError(DataError):
    """The data failed its quality suite; `reports` name the failed expectations per file."""

    def __init__(self, what: str, fix: str, reports: list[QualityReport]):
        super().__init__(what, fix)
        self.reports = reports


class QualityCheckError(RelayError):
    """great-expectations itself failed (not the data): the check could not be made."""

    retry_helps = False  # the same data and suite fail the same way


@dataclass
class Failure:
    expectation: str
    column: str | None
    unexpected_count: int | None
    unexpected_percent: float | None
    examples: list[Any]
    observed: object = None
    note: str = ""


@dataclass
class QualityReport:
    file: str
    rows: int
    suite: list[str] = field(default_factory=list)  # every expectation that ran
    failures: list[Failure] = field(default_factory=list)
    remembered: str | None = None  # a pass not run again: when these bytes passed this suite (its cache entry)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        head = (
            f"data quality of {self.file} ({self.rows} rows, {len(self.suite)} expectations): "
            + ("PASS" if self.ok else f"FAIL ({len(self.failures)} failed)")
            + (f" (remembered: these bytes passed this suite at {self.remembered})" if self.remembered else "")
        )
        lines = [head]
        for f in self.failures:
            where = f" on {f.column}" if f.column else ""
            # An aggregate expectation (distinct values, a mean...) may give a count without a percent.
            pct = f" ({f.unexpected_percent:.2f}%)" if f.unexpected_percent is not None else ""
            count = (
                f": {f.unexpected_count} rows{pct}"
                if f.unexpected_count is not None and pct
                else f": observed {f.observed!r}"
                if f.observed is not None
                else f": {f.unexpected_count} rows"
                if f.unexpected_count is not None
                else ""
            )
            lines.append(
                f"  ✘ {f.expectation}{where}{count}"
                + (f"; e.g. {f.examples}" if f.examples else "")
                + (f" ({f.note})" if f.note else "")
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), ok=self.ok)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)


def flatten(path: str | Path) -> pd.DataFrame:
    """The parquet file as a pandas DataFrame: struct fields flattened, prompt summarised."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - not parquet, truncated...
        raise DataError(f"{path} is not a readable parquet file ({e})", "check the file") from None
    df = table.flatten().to_pandas()
    if "prompt" in df.columns:
        df["prompt.valid"] = [_prompt_ok(p) for p in df["prompt"]]
    return df


def _prompt_ok(p: Any) -> bool:
    if isinstance(p, str):
        return bool(p.strip())
    try:
        msgs = list(p)
    except TypeError:
        return False
    return bool(msgs) and all(
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and m["role"]
        and isinstance(m.get("content"), str)
        and m["content"]
        for m in msgs
    )


def builtin_expectations(min_rows: int) -> list[Expectation]:
    """(expectation type, kwargs, what it means) for verl's RL schema."""
    return [
        ("expect_column_values_to_not_be_null", {"column": "data_source"}, "data_source is set"),
        ("expect_column_values_to_be_of_type", {"column": "data_source", "type_": "str"}, "data_source is a string"),
        (
            "expect_column_values_to_be_in_set",
            {"column": "prompt.valid", "value_set": [True]},
            "prompt is a non-empty chat list of {role, content}, or a non-empty string",
        ),
        ("expect_column_values_to_not_be_null", {"column": "reward_model.ground_truth"}, "ground_truth is set"),
        ("expect_column_values_to_be_unique", {"column": "extra_info.index"}, "extra_info.index is unique"),
        ("expect_table_row_count_to_be_between", {"min_value": min_rows}, f"at least {min_rows} rows (train_batch_size)"),
    ]


def load_expectations(path: Path) -> list[Expectation]:
    """A spec's own expectations: a YAML list of {type: expect_..., kwargs: {...}, meaning: "..."}."""
    try:
        items = yaml.safe_load(Path(path).read_text()) or []
    except (OSError, yaml.YAMLError) as e:
        raise DataError(f"cannot read expectations file {path}: {e}", "fix the file in include/expectations/") from None
    if not isinstance(items, list) or not all(isinstance(i, dict) and "type" in i for i in items):
        raise DataError(f"{path} must be a list of {{type: expect_..., kwargs: {{...}}}}", "see docs/guides/freezes.md")
    return [(i["type"], i.get("kwargs", {}), i.get("meaning", "")) for i in items]


def check(path: str | Path, *, min_rows: int = 1, extra: Sequence[Expectation] = ()) -> QualityReport:
    """Run the verl RL suite (and `extra` expectations) on a parquet file."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    df = flatten(path)
    report = QualityReport(str(path), len(df))
    columns = set(df.columns)
    for col in REQUIRED:
        if col not in columns:
            near = difflib.get_close_matches(col, sorted(columns), n=1)
            report.failures.append(
                Failure(
                    "required column present",
                    col,
                    None,
                    None,
                    [],
                    note=(f"column missing; renamed to {near[0]!r}?" if near else "column missing"),
                )
            )
    expectations = [e for e in [*builtin_expectations(min_rows), *extra] if e[1].get("column") in (None, *columns)]
    report.suite = [f"{t}({e.get('column', '')})" for t, e, _ in expectations]
    remembered = _pass_path(path, expectations) if not report.failures else None
    if remembered is not None and remembered.is_file():  # these bytes passed this suite before
        report.remembered = datetime.fromtimestamp(remembered.stat().st_mtime, UTC).isoformat(timespec="seconds")
        return report
    for result in _run_suite(df, expectations):
        if not result["success"]:
            report.failures.append(result["failure"])
    if remembered is not None and report.ok:
        _remember(remembered, report)
    return report


def _pass_path(path: str | Path, expectations: Sequence[Expectation]) -> Path | None:
    """Where a pass of this file's bytes against these expectations is remembered; None when turned off."""
    where = os.environ.get("RELAY_DATA_CHECK_CACHE", "")
    if where == "off":
        return None
    from importlib.metadata import version

    key = json.dumps(
        [sha256_file(path)[0], expectations, version("great_expectations"), CHECK_VERSION], sort_keys=True, default=str
    )
    base = Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "relay"
    return base / "data-checks" / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def _remember(target: Path, report: QualityReport) -> None:
    """Best effort: a cache that cannot be written only means the next check runs great-expectations again."""
    try:
        atomic_write(target, report.to_json().encode())
    except OSError:
        pass


def _run_suite(df: pd.DataFrame, expectations: Sequence[Expectation]) -> list[dict[str, Any]]:
    try:
        import great_expectations as gx
        import great_expectations.expectations as gxe
        from great_expectations.data_context.types.base import ProgressBarsConfig

        ctx = gx.get_context(mode="ephemeral")
        ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
        batch = ctx.data_sources.add_pandas("relay").add_dataframe_asset("data").add_batch_definition_whole_dataframe("all")
        suite = ctx.suites.add(gx.ExpectationSuite(name="verl_rl"))
        for type_, kwargs, meaning in expectations:
            cls = getattr(gxe, "".join(p.capitalize() for p in type_.split("_")), None)
            if cls is None:
                raise QualityCheckError(
                    f"unknown expectation {type_!r}", "use a great-expectations 1.x expectation name (expect_...)"
                )
            suite.add_expectation(cls(**kwargs, meta={"meaning": meaning}))
        vd = ctx.validation_definitions.add(gx.ValidationDefinition(name="relay", data=batch, suite=suite))
        index = ["extra_info.index"] if "extra_info.index" in df.columns else []
        res = vd.run(
            batch_parameters={"dataframe": df},
            result_format={
                "result_format": "SUMMARY",
                "partial_unexpected_count": EXAMPLES,
                "unexpected_index_column_names": index,
            },
        )
    except RelayError:
        raise
    except Exception as e:  # noqa: BLE001 - great-expectations' own failure: not a verdict on the data
        raise QualityCheckError(
            f"great-expectations failed while checking the data: {type(e).__name__}: {e}",
            "this is not a data problem; check the expectations files and the GE version",
        ) from None
    out: list[dict[str, Any]] = []
    for r in res.results:
        raised = _raised(r.exception_info)
        cfg = r.expectation_config
        assert cfg is not None  # GE sets it on each result of a suite it validated
        if raised:
            raise QualityCheckError(
                f"great-expectations raised inside {cfg.type}: {raised}",
                "this is not a data problem; check the expectation's arguments",
            )
        meaning = (cfg.meta or {}).get("meaning", "")
        res_d = r.result or {}
        # Examples name the offending rows by extra_info.index when GE can, else show their values.
        rows = [
            x.get("extra_info.index") if isinstance(x, dict) else x
            for x in (res_d.get("partial_unexpected_index_list") or [])
        ][:EXAMPLES]
        examples = [f"extra_info.index={i}" for i in rows] or list(res_d.get("partial_unexpected_list") or [])[:EXAMPLES]
        out.append(
            {
                "success": r.success,
                "failure": Failure(
                    cfg.type,
                    cfg.kwargs.get("column"),
                    res_d.get("unexpected_count"),
                    res_d.get("unexpected_percent"),
                    examples,
                    res_d.get("observed_value"),
                    meaning,
                ),
            }
        )
    return out


def _raised(info: object) -> str | None:
    if not isinstance(info, dict):
        return None
    if "raised_exception" in info:
        return info.get("exception_message") if info["raised_exception"] else None
    return next(
        (v.get("exception_message") for v in info.values() if isinstance(v, dict) and v.get("raised_exception")), None
    )
