"""The run report: a picture of a training run, built from what its folder already records.

    metrics.jsonl            one row per step (superseded rows already moved aside by each resume)
    events.jsonl             chunk attempts (chunk_start / chunk_end), checkpoints, quarantines,
                             fallbacks, restores, publications, source drift
    .relay/run.json          the run record: settings fingerprint, frozen data, drift decisions
    global_step_N/relay_manifest.json, .relay/quarantine/*.report.json, and the store's manifests

Outputs: report.png (reward mean, loss, KL, LR and seconds per step over global steps, with chunk
boundaries, resumes, retries, quarantines and drift marked), report.html (self-contained: the PNG
inline, the chunk table, the fingerprints) and a few lines of text for terminals. `publish` puts
both files beside the run's checkpoints in S3, with the run's metrics, events and record, so that
`python -m relay report s3://bucket/prefix/<run>` can rebuild the report from S3 alone.

matplotlib is imported only inside the plotting function, so importing this module stays light.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relay.checkpoints import manifest
from relay.checkpoints.resume import quarantined
from relay.common import files
from relay.common.errors import UsageError
from relay.common.redaction import redact
from relay.common.timestamps import epoch
from relay.insights import goodput
from relay.insights.audit import AuditReport, audit
from relay.insights.save_interval import SaveInterval, save_interval
from relay.runs import layout
from relay.runs.metrics import SUPERSEDED, read_jsonl
from relay.runs.record import read_record
from relay.runs.run import Run
from relay.s3 import history
from relay.s3.store import CheckpointStore, parse_uri, s3_client
from relay.spec.plan import ChunkPlan

REPORT_DIR = "report"  # <run_dir>/.relay/report/ locally, s3://…/<run>/report/ in S3
HTML, PNG = "report.html", "report.png"
JSON_VERSION = 1  # of `relay report --json`
# (panel title, metric keys in order of preference): the keys the CPU trainer writes per step.
PANELS = (
    ("reward mean", ("reward_mean",)),
    ("loss", ("loss",)),
    ("KL", ("kl",)),
    ("LR", ("lr",)),
    ("seconds per step", ("seconds",)),
)
LABEL_ROWS = 8  # at most, above the panels
PART_COLOURS = {  # the goodput ledger's parts (relay.insights.goodput.PARTS): kept steps green, lost ones red
    "training": "#2ca02c",
    "trained_twice": "#d62728",
    "save": "#1f77b4",
    "validation": "#17becf",
    "publication": "#bcbd22",
    "startup": "#ff7f0e",
    "handoff": "#ffbb78",
    "submission": "#9467bd",
    "capacity_wait": "#f4a261",
    "scheduling": "#8c564b",
    "teardown": "#e377c2",
    "retry_wait": "#7f7f7f",
    "idle": "#c7c7c7",
}
MARKER_STYLE = {  # kind -> (colour, line style)
    "chunk": ("#9e9e9e", ":"),
    "resume": ("#1f77b4", "--"),
    "retry": ("#ff7f0e", "--"),
    "quarantine": ("#d62728", "-"),
    "fallback": ("#8c564b", "-."),
    "restore": ("#8c564b", "-."),
    "drift": ("#9467bd", "-."),
    "divergence": ("#e377c2", "-"),
}


class ReportError(UsageError):
    """A run report cannot be built: nothing recorded where it was looked for (not a run's folder or prefix)."""


@dataclass(frozen=True)
class Marker:
    """Something that happened at a global step: the x position of a line on every panel."""

    step: int
    kind: str  # chunk | resume | retry | quarantine | fallback | restore | drift | divergence
    label: str
    chunk: int | None = None
    attempt: int | None = None  # 1-based within its chunk


@dataclass
class Attempt:
    """One trainer process of a chunk, from its chunk_start event (and chunk_end, unless it was killed)."""

    attempt: str  # the Ray submission id, or "local" for `relay train`
    resumed_from: int
    to_step: int
    started: float | None
    ended: float | None = None  # the chunk_end time, or the last step row's of a killed attempt
    seconds: float | None = None  # chunk_end's (the trainer process); a killed one's up to its last row
    finished: bool = False
    chunk: int | None = None
    certificate: str | None = None  # the resume's: certified or uncertified (relay.checkpoints.certificate)
    warm: bool = False  # started warm, in the job that trained the chunk before (chunks.handoff: warm)


@dataclass
class ChunkRow:
    chunk: int
    start_step: int
    end_step: int
    attempts: int
    wall_seconds: float | None  # first attempt's start to the last one's end: retries and waits included
    trainer_seconds: float | None  # the attempts' trainer processes together
    checkpoint_bytes: int | None
    validation: str
    s3_uri: str | None
    resumed_from: list[int] = field(default_factory=list)


@dataclass
class Report:
    run: str
    source: str  # the run folder, or its S3 URI
    rows: list[dict]  # the current metrics, one row per step, ascending
    superseded_rows: int
    chunks: list[ChunkRow]
    markers: list[Marker]
    total_steps: int | None
    settings_fingerprint: str | None
    data_fingerprint: str | None
    data_files: list[dict]
    drift: list[dict]
    audit: AuditReport | None = None  # the replay audit of the steps trained twice
    save_interval: SaveInterval | None = None  # Young–Daly from the run's measured costs
    goodput: goodput.Ledger | None = None  # where the wall time went, what failures cost
    incarnation: dict = field(default_factory=dict)  # this life of the run: id, begun, by whom, the old one's place
    decisions: list[str] = field(default_factory=list)  # what people decided: fresh starts, drift, fallbacks
    world_sizes: dict[str, int] = field(default_factory=dict)  # an attempt's world size, from its chunk_start

    def world_size_bands(self) -> list[tuple[int, int, int]]:
        """(first step, last step, world size) of each stretch of kept steps trained at one world size: an elastic
        run's band on the plot (empty when no attempt said its size)."""
        out: list[tuple[int, int, int]] = []
        for r in self.rows:
            size = self.world_sizes.get(str(r.get("attempt")))
            if size is None:
                continue
            if out and out[-1][2] == size and out[-1][1] == r["step"] - 1:
                out[-1] = (out[-1][0], r["step"], size)
            else:
                out.append((r["step"], r["step"], size))
        return out

    @property
    def steps(self) -> list[int]:
        return [r["step"] for r in self.rows]

    def series(self, keys: tuple[str, ...]) -> tuple[list[int], list[float]]:
        """(steps, values) of the first key the rows carry."""
        for key in keys:
            pts = [(r["step"], float(r[key])) for r in self.rows if isinstance(r.get(key), (int, float))]
            if pts:
                return [s for s, _ in pts], [v for _, v in pts]
        return [], []

    # ------------------------------------------------------------------------------ text
    def summary(self) -> str:
        """A few lines for a terminal."""
        last = self.steps[-1] if self.rows else 0
        attempts = sum(c.attempts for c in self.chunks)
        retries = sum(1 for m in self.markers if m.kind == "retry")
        quarantines = sum(1 for m in self.markers if m.kind == "quarantine")
        lines = [
            f"run {self.run}: step {last} of {self.total_steps or '?'}, {_n(len(self.chunks), 'chunk')}, "
            f"{_n(attempts, 'attempt')} ({_n(retries, 'retry', 'retries')}), {quarantines} quarantined, "
            f"{_n(len(self.drift), 'drift decision')}"
        ]
        _steps, reward = self.series(PANELS[0][1])
        if reward:
            n = min(10, len(reward))
            _, secs = self.series(PANELS[4][1])
            per = f"; {sum(secs) / len(secs):.3f} s/step" if secs else ""
            lines.append(
                f"reward_mean: first {n} steps {sum(reward[:n]) / n:.3f} -> last {n} steps {sum(reward[-n:]) / n:.3f}{per}"
            )
        resumed = [m.label for m in self.markers if m.kind in ("resume", "retry")]
        if resumed:
            lines.append("resumes: " + "; ".join(resumed))
        bands = self.world_size_bands()
        if len({size for *_, size in bands}) > 1:
            lines.append("world size: " + ", ".join(f"{size} (steps {a}-{b})" for a, b, size in bands))
        if self.goodput is not None:
            lines.append(self.goodput.summary())
        if self.audit is not None and self.audit.compared:
            lines.append(self.audit.summary().splitlines()[0])
        if self.audit is not None and self.audit.prompts is not None:
            lines.append(self.audit.prompts.summary().splitlines()[0])
        if self.save_interval is not None:
            lines.append(f"save interval: {self.save_interval.advice()}")
        data = self.data_fingerprint[:16] if self.data_fingerprint else "none (data never frozen)"
        lines.append(f"data fingerprint {data}, settings fingerprint {(self.settings_fingerprint or 'none')[:16]}")
        return "\n".join(lines)

    def labelled_markers(self) -> list[Marker]:
        """Markers named on the picture: all but chunk ends and the plain resume of a chunk from the
        previous chunk's end (the line is drawn; its label would only repeat the boundary's)."""
        ends = {m.step for m in self.markers if m.kind == "chunk"}
        return [m for m in self.markers if m.kind != "chunk" and not (m.kind == "resume" and m.step in ends)]

    # ------------------------------------------------------------------------------ picture
    def plot_png(self) -> bytes:
        """The panels as PNG bytes (matplotlib's Agg canvas; no pyplot, no global backend). Named markers
        are labelled in a strip above the panels, one row per label that would overlap another."""
        # Imported here, like torch elsewhere: matplotlib costs a third of a second, and the DAG file, every
        # Airflow task and every `relay` command import this module without drawing anything.
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D

        right = max([self.total_steps or 0, *self.steps, *(m.step for m in self.markers), 1])
        xmax = right + max(1, right // 50)
        labels = _label_rows(self.labelled_markers(), xmax)
        rows = max((r for _, r, _ in labels), default=-1) + 1
        strip = [0.22 * rows + 0.1] if rows else []
        bars = self.goodput.chunks() if self.goodput is not None else []
        bars_h = 1.5 + 0.4 * len(bars) if bars else 0.0
        height = 2.2 * len(PANELS) + 0.3 * rows + 0.6
        fig = Figure(figsize=(11, height + bars_h), dpi=100, layout="constrained")
        over_steps: Any = fig
        if bars:  # the goodput bars below the panels, on an axis of their own (seconds, not steps)
            halves: Any = fig.subfigures(2, 1, height_ratios=[height, bars_h])
            over_steps = halves[0]
            self._plot_goodput(halves[1], bars)
        axes = over_steps.subplots(
            len(strip) + len(PANELS), 1, sharex=True, gridspec_kw={"height_ratios": strip + [1] * len(PANELS)}
        )
        for ax in axes:
            for m in self.markers:
                colour, style = MARKER_STYLE[m.kind]
                ax.axvline(m.step, color=colour, ls=style, lw=1.0 if m.kind == "chunk" else 1.3, alpha=0.9)
        if rows:
            top = axes[0]
            top.set_ylim(rows - 0.4, -0.6)
            top.set_yticks([])
            top.tick_params(axis="x", length=0)
            for side in ("top", "right", "left"):
                top.spines[side].set_visible(False)
            for m, row, left in labels:
                top.annotate(
                    m.label,
                    (m.step, row),
                    xytext=(3 if left else -3, 0),
                    textcoords="offset points",
                    ha="left" if left else "right",
                    va="center",
                    fontsize=7,
                    color=MARKER_STYLE[m.kind][0],
                )
        panels = axes[len(strip) :]
        bands = self.world_size_bands()
        largest = max([size for *_, size in bands] + [(self.goodput and self.goodput.largest_world_size) or 0])
        for ax in panels:  # an elastic run's steps trained below its largest world size, shaded
            for first, last, size in bands:
                if size < largest:
                    ax.axvspan(first - 0.5, last + 0.5, color="#f4a261", alpha=0.18, lw=0)
        for first, last, size in bands if len({s for *_, s in bands}) > 1 else []:
            panels[0].annotate(
                f"world size {size}",
                ((first + last) / 2, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(0, -9),
                textcoords="offset points",
                ha="center",
                fontsize=7,
                color="#b5651d" if size < largest else "#555",
            )
        for ax, (title, keys) in zip(panels, PANELS, strict=False):
            steps, values = self.series(keys)
            if steps:
                ax.plot(steps, values, color="#2a6f97", lw=1.4, marker="." if len(steps) <= 80 else None, ms=3)
            else:
                ax.text(
                    0.5,
                    0.5,
                    f"no {'/'.join(keys)} in the metrics",
                    transform=ax.transAxes,
                    ha="center",
                    va="center",
                    color="#777",
                )
            ax.set_ylabel(title)
            ax.grid(True, alpha=0.25)
        kinds = sorted({m.kind for m in self.markers}, key=list(MARKER_STYLE).index)
        if kinds:
            panels[0].legend(
                [Line2D([], [], color=MARKER_STYLE[k][0], ls=MARKER_STYLE[k][1]) for k in kinds],
                [k if k != "chunk" else "chunk end" for k in kinds],
                loc="lower right",
                fontsize=7,
                ncols=len(kinds),
                framealpha=0.8,
            )
        panels[-1].set_xlabel("global step")
        panels[-1].set_xlim(0, xmax)
        fig.suptitle(f"run {self.run}: step {self.steps[-1] if self.rows else 0} of {self.total_steps or '?'}")
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    def _plot_goodput(self, fig, bars: list[dict]) -> None:
        """The goodput ledger as one stacked bar per chunk: its attempts' wall time by part."""
        assert self.goodput is not None
        ax = fig.subplots(1, 1)
        lost: dict[tuple, int] = {}
        for a in self.goodput.attempts:
            lost[(a.chunk, a.to_step)] = lost.get((a.chunk, a.to_step), 0) + a.steps_lost
        shown = [k for k in goodput.PARTS if any(c["parts"][k] > 0 for c in bars)]
        for y, c in enumerate(bars):
            left = 0.0
            for k in shown:
                ax.barh(
                    y,
                    c["parts"][k],
                    left=left,
                    color=PART_COLOURS[k],
                    height=0.6,
                    label=k.replace("_", " ") if y == 0 else None,
                )
                left += c["parts"][k]
            note = f" {c['attempts']} attempt{'s' if c['attempts'] != 1 else ''}"
            if n := lost.get((c["chunk"], c["to_step"])):
                note += f", {n} step{'s' if n != 1 else ''} lost"
            ax.text(left, y, note, va="center", fontsize=7, color="#d62728" if n else "#555")
        ax.set_yticks(
            range(len(bars)), [f"chunk {c['chunk']}" if c["chunk"] is not None else f"to step {c['to_step']}" for c in bars]
        )
        ax.invert_yaxis()
        ax.set_xlabel("seconds of wall time")
        ax.set_xlim(0, max(c["seconds"] for c in bars) * 1.2 or 1)
        ax.grid(True, axis="x", alpha=0.25)
        fig.legend(loc="outside lower center", fontsize=7, ncols=len(shown), frameon=False)
        ax.set_title(self.goodput.summary().partition(";")[0] + " (wall time of each chunk's attempts, by part)", fontsize=9)

    def incidents(self) -> list[Marker]:
        """What went wrong or was set right: retries, quarantines, fallbacks, restores, drift, divergences. A
        chunk's planned handoff to the next (its resume from the previous chunk's end) is routine, not one."""
        return [m for m in self.markers if m.kind not in ("chunk", "resume")]

    def html(self, png: bytes, back: str | None = None) -> str:
        """One self-contained page: the picture inline (base64), the chunk table, the fingerprints. `back`: the
        page a person came from (the DAG run in Airflow's UI), linked at the top."""
        e = html.escape

        def cell(v) -> str:
            return f"<td>{'—' if v is None or v == '' else e(str(v))}</td>"

        def location(uri: str | None) -> str:
            """An s3:// location as text a browser cannot open, with a button that copies it."""
            if not uri:
                return "—"
            return f'<code>{e(uri)}</code> <button class="copy" data-copy="{e(uri)}" title="copy">copy</button>'

        rows = "\n".join(
            f'<tr class="chunk" id="step-{c.end_step}" data-chunk="{c.chunk}">'
            + "".join(
                cell(v)
                for v in (
                    c.chunk,
                    c.start_step,
                    c.end_step,
                    c.attempts,
                    _duration(c.wall_seconds),
                    _duration(c.trainer_seconds),
                    _size(c.checkpoint_bytes),
                    c.validation,
                )
            )
            + f"<td>{location(c.s3_uri)}</td></tr>"
            for c in self.chunks
        )
        marks = "\n".join(f'<li class="marker {e(m.kind)}">step {m.step}: {e(m.label)}</li>' for m in self.incidents())
        files = "".join(
            f"<li>{e(f.get('role', '?'))} <code>{e(f.get('sha256', ''))}</code> ({f.get('rows')} rows, "
            f"from {e(str(f.get('source')))})</li>"
            for f in self.data_files
        )
        decisions = "".join(f"<li>{e(d)}</li>" for d in self.decisions)
        inc = self.incarnation
        life = (
            f'<p id="incarnation">Incarnation <code>{e(str(inc.get("id") or "1"))}</code>'
            + (f", begun {e(str(inc['began']))}" if inc.get("began") else "")
            + (f" by {e(str(inc['by']))}" if inc.get("by") else "")
            + ".</p>"
        )
        if inc.get("archived_to") or inc.get("archived_uri"):
            life += (
                "<p>The previous incarnation was moved aside, never deleted: "
                + " and ".join(location(x) for x in (inc.get("archived_to"), inc.get("archived_uri")) if x)
                + "</p>"
            )
        image = "data:image/png;base64," + base64.b64encode(png).decode()
        ledger = self._goodput_html()
        backlink = f'<p><a id="back" href="{e(back)}">&larr; Back to the DAG run in Airflow</a></p>' if back else ""
        return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Relay run report: {e(self.run)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1200px; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; }}
th {{ background: #f2f2f2; }} code {{ font-size: 0.9em; }} img {{ max-width: 100%; }}
pre {{ background: #f7f7f7; padding: 0.8em; white-space: pre-wrap; overflow-wrap: anywhere; }}
tr {{ scroll-margin-top: 4em; }} tr:target {{ background: #fff3b0; outline: 2px solid #e0b000; }}
button.copy {{ font-size: 0.8em; cursor: pointer; }}
</style>
<script>
document.addEventListener("click", (ev) => {{
  const b = ev.target.closest("button.copy");
  if (!b) return;
  navigator.clipboard.writeText(b.dataset.copy).then(() => {{ b.textContent = "copied"; }});
}});
</script></head><body>
{backlink}
<h1>Run {e(self.run)}</h1>
<p>Source: <code>{e(self.source)}</code>; written {e(time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()))}</p>
{life}
<pre>{e(self.summary())}</pre>
<img alt="reward mean, loss, KL, LR and seconds per step over global steps" src="{image}">
<h2>Chunks</h2>
<table id="chunks"><tr><th>chunk</th><th>start step</th><th>end step</th><th>attempts</th><th>wall time</th>
<th>trainer time</th><th>checkpoint size</th><th>validation</th><th>S3 URI</th></tr>
{rows}
</table>
<h2>Goodput</h2>
{ledger}
{self._prompts_html()}
<h2>Incidents: retries, quarantines, fallbacks, restores, drift</h2>
<ul id="markers">{marks or "<li>none</li>"}</ul>
<h2>Decisions</h2>
<ul id="decisions">{decisions or "<li>none</li>"}</ul>
<h2>Fingerprints</h2>
<p>Settings fingerprint: <code id="settings-fingerprint">{e(self.settings_fingerprint or "none")}</code></p>
<p>Data fingerprint: <code id="data-fingerprint">{e(self.data_fingerprint or "none (data never frozen)")}</code></p>
<ul>{files}</ul>
<p>{_n(self.superseded_rows, "step row")} trained again after resumes (the first tries' rows are kept in
{SUPERSEDED}).</p>
</body></html>
"""

    def _prompts_html(self) -> str:
        """An asynchronous trainer's steps: the policy version each trained and its staleness (relay.insights.prompts)."""
        p = self.audit.prompts if self.audit is not None else None
        if p is None:
            return ""
        e = html.escape
        body = "\n".join(
            f'<tr class="staleness" data-step="{r["step"]}"><td>{r["step"]}</td>'
            f"<td>{e(', '.join(sorted({str(v) for v in r.get('policy_versions', [])})))}</td>"
            f"<td>{e(', '.join(sorted({str(v) for v in p.staleness.get(r['step'], [])})) or '—')}</td>"
            f"<td>{len(r.get('prompt_seqs', []))}</td><td>{len(r.get('handed_out_seqs', []))}</td></tr>"
            for r in self.rows
            if "prompt_seqs" in r
        )
        return f"""<h2>Prompts and staleness (asynchronous trainer)</h2>
<pre id="prompt-audit">{e(p.summary())}</pre>
<table id="staleness"><tr><th>step</th><th>policy version generated with</th><th>staleness (steps)</th>
<th>prompts trained</th><th>prompts handed out</th></tr>
{body}
</table>"""

    def _goodput_html(self) -> str:
        """The ledger's parts (run totals) and its table of failures."""
        g, e = self.goodput, html.escape
        if g is None:
            return "<p>No chunk attempt recorded yet.</p>"
        parts = "\n".join(
            f'<tr class="part" data-part="{k}"><td>{e(k)}</td><td>{g.parts[k]:.1f}</td>'
            f"<td>{g.parts[k] / g.wall_s if g.wall_s else 0:.1%}</td><td>{e(what)}</td></tr>"
            for k, what in goodput.PARTS.items()
        )
        failures = "\n".join(
            f'<tr class="failure"><td>{f.chunk if f.chunk is not None else "—"}</td><td><code>{e(f.attempt)}</code></td>'
            f"<td>{e(f.outcome)}</td><td>{e(f.cause)}</td><td>{f.step if f.step is not None else '—'}</td>"
            f"<td>{f.steps_lost}</td><td>{f.lost_s:.1f}</td>"
            f"<td>{'not yet' if f.time_to_recover_s is None else f'{f.time_to_recover_s:.1f}'}</td></tr>"
            for f in g.failures
        )
        return f"""<p id="goodput-summary">{e(g.summary())}</p>
<table id="goodput"><tr><th>part</th><th>seconds</th><th>share of {g.wall_s:.1f} s</th><th>what it is</th></tr>
{parts}
</table>
<h3>Failures</h3>
<table id="failures"><tr><th>chunk</th><th>attempt</th><th>outcome</th><th>cause</th><th>last step trained</th>
<th>steps lost</th><th>their seconds</th><th>seconds to recover</th></tr>
{failures or '<tr><td colspan="8">none</td></tr>'}
</table>"""

    def to_dict(self) -> dict:
        """`relay report --json`: stable keys (docs/guides/report.md lists them)."""
        return {
            "version": JSON_VERSION,
            "run": self.run,
            "source": self.source,
            "step": self.steps[-1] if self.rows else 0,
            "total_steps": self.total_steps,
            "steps_superseded": self.superseded_rows,
            "goodput": self.goodput.to_dict() if self.goodput is not None else None,
            "chunks": [asdict(c) for c in self.chunks],
            "markers": [asdict(m) for m in self.markers if m.kind != "chunk"],
            "audit": self.audit.to_dict() if self.audit is not None else None,
            "save_interval": self.save_interval.to_dict() if self.save_interval is not None else None,
            "settings_fingerprint": self.settings_fingerprint,
            "data_fingerprint": self.data_fingerprint,
        }


# ---------------------------------------------------------------------------------------- building
def build(run_dir: Path, *, store=None, run: str | None = None, plan=None, source: str | None = None, spec=None) -> Report:
    """The report of a run folder. With a store, published manifests give S3 URIs and sizes; with a
    ChunkPlan, every planned chunk gets a row (those not reached yet too); with the run's spec, the replay
    audit allows its audit.tolerance (exact without it) and the save interval advice uses its settings."""
    run_dir = Path(run_dir)
    run = run or run_dir.name
    rows = current_rows(read_jsonl(run_dir / layout.METRICS))
    events = read_jsonl(run_dir / layout.EVENTS)
    record = read_record(run_dir)
    if not rows and not events:
        raise ReportError(
            f"run {run}: no {layout.METRICS} and no {layout.EVENTS} in {source or run_dir}",
            "give the run's folder (<checkpoint_dir>/<run>) or its S3 URI, once a chunk has trained",
        )
    superseded = read_jsonl(run_dir / SUPERSEDED)
    published = {m.step: m for m in store.published(run)} if store is not None else {}
    attempts = _attempts(events, rows + superseded)
    chunks, markers = _chunks(run_dir, run, attempts, events, published, store, plan)
    markers += _incidents(run_dir, events)
    markers += _drift_markers(record, events, attempts, rows)
    replay = audit(run_dir, spec.audit.tolerance if spec is not None else None)
    markers += [
        Marker(step, "divergence", f"diverged from its first try: {', '.join(sorted(metrics))}")
        for step, metrics in _by_step(replay.divergences).items()
    ]
    data = (record.get("data") or {}).get("files") or []
    return Report(
        run=run,
        source=source or str(run_dir),
        rows=rows,
        superseded_rows=len(superseded),
        chunks=chunks,
        markers=sorted(_dedupe(markers), key=lambda m: (m.step, list(MARKER_STYLE).index(m.kind))),
        total_steps=(record.get("resume_critical") or {}).get("total_steps") or (plan.total_steps if plan else None),
        settings_fingerprint=record.get("settings_fingerprint"),
        data_fingerprint=data_fingerprint(data),
        data_files=data,
        drift=record.get("drift") or [],
        audit=replay,
        save_interval=_save_interval(run_dir, spec, plan),
        goodput=goodput.build(events, rows, superseded),
        incarnation=_incarnation(record),
        decisions=_decisions(record, events),
        world_sizes={
            str(e["attempt"]): int(e["world_size"])
            for e in events
            if e.get("event") == "chunk_start" and e.get("world_size") and e.get("attempt")
        },
    )


def _incarnation(record: dict) -> dict:
    """This life of the run, from its record: its id, when and by whom it began, where the old life went."""
    previous = record.get("previous") or {}
    return {
        "id": record.get("incarnation"),
        "began": record.get("created"),
        "by": record.get("started_by"),
        "archived_to": previous.get("archived_to"),
        "archived_uri": previous.get("archived_uri"),
    }


def _decisions(record: dict, events: list[dict]) -> list[str]:
    """What people decided about the run, oldest first: a fresh start, accepted settings changes, fallbacks."""
    out = []
    if record.get("previous"):
        out.append(
            f"{record.get('created', '?')}: started again from step 0 as a new incarnation "
            f"({record.get('started_by') or 'by a trigger'})"
        )
    for d in record.get("drift") or []:
        keys = ", ".join(f"{c['key']}: {c['was']!r} -> {c['now']!r}" for c in d.get("changes", []))
        out.append(f"{d.get('at', '?')}: settings change accepted by {d.get('by') or '?'}: {keys}")
    for e in events:
        if e.get("event") == "fallback_approved":
            out.append(
                f"{e.get('at') or e.get('time', '?')}: {e.get('by', '?')} approved resuming chunk "
                f"{e.get('chunk')} from step {e.get('resume_from')}, below quarantined step {e.get('quarantined')}"
            )
    return out


def _save_interval(run_dir: Path, spec, plan) -> SaveInterval | None:
    """Young–Daly from the run's costs: with the spec's save_freq and mtbf_hours, else from the plan alone."""
    if spec is not None:
        return save_interval(
            run_dir,
            chunk_steps=spec.chunk_steps,
            save_freq=spec.core_settings.save_freq,
            mtbf_hours=spec.checkpoints.mtbf_hours,
            total_steps=spec.total_steps,
        )
    if plan is not None and plan.chunks:
        return save_interval(run_dir, chunk_steps=plan.chunks[0].steps, total_steps=plan.total_steps)
    return None


def _by_step(divergences) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for d in divergences:
        out.setdefault(d.step, set()).add(d.metric)
    return out


def current_rows(rows: list[dict]) -> list[dict]:
    """One row per step (the last written wins), ascending: the run's current trajectory. A resume has
    already moved the rows it trains again to metrics.superseded.jsonl, so none of them is drawn."""
    by_step = {r["step"]: r for r in rows if isinstance(r.get("step"), int)}
    return [by_step[s] for s in sorted(by_step)]


def data_fingerprint(files: list[dict]) -> str | None:
    """sha256 over the frozen files' roles and content hashes (not their paths): same bytes, same print."""
    if not files:
        return None
    return hashlib.sha256("\n".join(sorted(f"{f['role']}:{f['sha256']}" for f in files)).encode()).hexdigest()


def _ts(text: str | None) -> float | None:
    return epoch(text) if text is not None else None


def _attempts(events: list[dict], all_rows: list[dict]) -> list[Attempt]:
    """Chunk attempts in order; each chunk_end closes the latest open attempt of the same id.

    A killed attempt has no chunk_end: its end is the time of the last step row written before the
    next attempt began (rows it wrote past the resume point are in metrics.superseded.jsonl)."""
    out: list[Attempt] = []
    for e in events:
        if e.get("event") == "chunk_start":
            out.append(
                Attempt(
                    str(e.get("attempt")),
                    int(e.get("resumed_from") or 0),
                    int(e.get("to_step") or 0),
                    _ts(e.get("time")),
                    chunk=e.get("chunk"),
                    certificate=e.get("certificate"),
                    warm=bool(e.get("warm")),
                )
            )
        elif e.get("event") == "resume_certificate":  # verl's trainer checks it after chunk_start, in its actor
            a = next((a for a in reversed(out) if a.attempt == str(e.get("attempt"))), None)
            if a is not None:
                a.certificate = e.get("certificate")
        elif e.get("event") == "chunk_end":
            a = next(
                (
                    a
                    for a in reversed(out)
                    if a.attempt == str(e.get("attempt")) and not a.finished and a.chunk in (None, e.get("chunk"))
                ),
                None,
            )
            if a is not None:
                a.finished, a.ended, a.seconds = True, _ts(e.get("time")), e.get("seconds")
    for i, a in enumerate(out):
        if a.finished or a.started is None:
            continue
        until = out[i + 1].started if i + 1 < len(out) and out[i + 1].started is not None else float("inf")
        times = [
            r["time"]
            for r in all_rows
            if isinstance(r.get("time"), (int, float))
            and a.started <= r["time"] < until
            and a.resumed_from < r.get("step", 0) <= a.to_step
        ]
        if times:
            a.ended = max(times)
            a.seconds = round(a.ended - a.started, 3)
    return out


def _chunks(
    run_dir: Path, run: str, attempts: list[Attempt], events: list[dict], published: dict, store, plan
) -> tuple[list[ChunkRow], list[Marker]]:
    """The chunk table (grouped by end step: chunk k always ends at the same step) and its markers."""
    by_end: dict[int, list[Attempt]] = {}
    for a in attempts:
        by_end.setdefault(a.to_step, []).append(a)
    planned = {c.end_step: c for c in plan.chunks} if plan is not None else {}
    ends = sorted(set(by_end) | set(planned))
    published_uri = {e["step"]: e["uri"] for e in events if e.get("event") == "publish" and e.get("uri")}
    quarantine_check = {m.step: m.label for m in _incidents(run_dir, events) if m.kind == "quarantine"}
    rows, markers = [], []
    for i, end in enumerate(ends, 1):
        tries = by_end.get(end, [])
        index = planned[end].index if end in planned else next((a.chunk for a in tries if a.chunk), None) or i
        start = tries[0].resumed_from + 1 if tries else planned[end].first_step
        for n, a in enumerate(tries, 1):
            if a.resumed_from > 0:
                kind = "retry" if n > 1 else "resume"
                how = "started warm at" if a.warm else "resumed from"
                label = (
                    f"chunk {index} retry (attempt {n}) {how} step {a.resumed_from}"
                    if n > 1
                    else f"chunk {index} {how} step {a.resumed_from}"
                ) + (f" ({a.certificate} resume)" if a.certificate else "")
                markers.append(Marker(a.resumed_from, kind, label, index, n))
        markers.append(Marker(end, "chunk", f"chunk {index} ends", index))
        local = manifest.read(layout.step_dir(run_dir, end)) if layout.step_dir(run_dir, end).is_dir() else None
        m = local or published.get(end)
        uri = published_uri.get(end) or (store.step_uri(run, end) if end in published else None)
        if m is not None or end in published_uri:
            # a level that did not run is said, never counted as passed (manifest version 4)
            skipped = sorted(getattr(m, "skipped", None) or {})
            validation = f"valid ({', '.join(skipped)} skipped)" if skipped else "valid"
        elif end in quarantine_check:
            validation = quarantine_check[end]
        elif layout.step_dir(run_dir, end).is_dir():
            validation = "not validated yet"
        else:
            validation = "not reached" if not any(a.finished and a.to_step == end for a in tries) else "no checkpoint"
        size = m.total_bytes if m is not None else _folder_bytes(layout.step_dir(run_dir, end))
        # A finished attempt's process began `seconds` before its chunk_end (chunk_start comes after the
        # trainer's set-up); a killed one is counted from its chunk_start.
        t0 = min(
            (
                a.ended - a.seconds if a.finished and a.ended and a.seconds else a.started
                for a in tries
                if a.started is not None
            ),
            default=None,
        )
        t1 = max((a.ended for a in tries if a.ended is not None), default=None)
        secs = [a.seconds for a in tries if a.seconds is not None]
        rows.append(
            ChunkRow(
                index,
                start,
                end,
                len(tries),
                round(t1 - t0, 3) if t0 and t1 else None,
                round(sum(secs), 3) if secs else None,
                size,
                validation,
                uri,
                [a.resumed_from for a in tries],
            )
        )
    return rows, markers


def _folder_bytes(folder: Path) -> int | None:
    if not folder.is_dir():
        return None
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _incidents(run_dir: Path, events: list[dict]) -> list[Marker]:
    """Quarantines (events and the quarantine folder's reports), fallbacks and restores."""
    out = []
    for e in events:
        kind, step = e.get("event"), e.get("step")
        if not isinstance(step, int):
            continue
        if kind == "quarantine":
            out.append(Marker(step, "quarantine", f"quarantined: {e.get('check')} failed"))
        elif kind == "fallback":
            out.append(Marker(step, "fallback", f"fell back to step {step} (tracker named {e.get('tracker_was')})"))
        elif kind == "restore":
            out.append(Marker(step, "restore", f"restored step {step} from S3"))
    for q in quarantined(run_dir):
        if isinstance(q.get("step"), int):
            failed = next((c["name"] for c in q.get("checks", []) if not c.get("ok")), "?")
            out.append(Marker(q["step"], "quarantine", f"quarantined: {failed} failed"))
    return out


def _drift_markers(record: dict, events: list[dict], attempts: list[Attempt], rows: list[dict]) -> list[Marker]:
    """Drift takes effect at the next resume: a decision is marked at the step the next attempt after
    it resumed from (or at the last step trained, when no attempt has started since)."""

    def step_after(t: float | None) -> int:
        nxt = next((a for a in attempts if t is not None and a.started is not None and a.started >= t), None)
        return nxt.resumed_from if nxt else (rows[-1]["step"] if rows else 0)

    out = []
    for d in record.get("drift") or []:
        keys = sorted({c["key"] for c in d.get("changes", []) if not c["key"].startswith("resolved.")}) or sorted(
            {c["key"] for c in d.get("changes", [])}
        )
        out.append(Marker(step_after(_ts(d.get("at"))), "drift", f"drift allowed: {', '.join(keys)}"))
    for e in events:
        if e.get("event") == "source_drift":
            out.append(
                Marker(
                    step_after(_ts(e.get("time"))),
                    "drift",
                    f"data source changed ({e.get('policy')}: training stays on the frozen copy)",
                )
            )
    return out


def _label_rows(markers: list[Marker], xmax: float) -> list[tuple[Marker, int, bool]]:
    """(marker, row, text to the right of its line) for each label: the first row where it overlaps no
    other label. Text widths are estimated (7-point text: about 5 of the axes' 1000 pixels a character)."""
    per_char = 5.2 / 1000 * xmax
    taken: list[list[tuple[float, float]]] = []
    out: list[tuple[Marker, int, bool]] = []
    for m in sorted(markers, key=lambda m: m.step):
        width = (len(m.label) + 1) * per_char
        left = m.step + width <= xmax
        span = (m.step, m.step + width) if left else (m.step - width, m.step)
        row = next((i for i, spans in enumerate(taken) if all(span[1] < a or span[0] > b for a, b in spans)), len(taken))
        if row == LABEL_ROWS:
            row = len(out) % LABEL_ROWS  # a crowded run: some labels overlap rather than the strip growing
        elif row == len(taken):
            taken.append([])
        taken[row].append(span)
        out.append((m, row, left))
    return out


def _dedupe(markers: list[Marker]) -> list[Marker]:
    seen, out = set(), []
    for m in markers:
        if (m.step, m.kind, m.label) not in seen:
            seen.add((m.step, m.kind, m.label))
            out.append(m)
    return out


def _n(count: int, one: str, many: str | None = None) -> str:
    return f"{count} {one if count == 1 else many or one + 's'}"


def _duration(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _size(n: float | None) -> str | None:
    if n is None:
        return None
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return None


# ---------------------------------------------------------------------------------------- output
def default_out(run_dir: Path) -> Path:
    return layout.relay_dir(run_dir, REPORT_DIR)


def write(report: Report, out_dir: Path) -> dict[str, Path]:
    """Write report.png and report.html into out_dir; returns their paths."""
    out_dir = Path(out_dir)
    png = report.plot_png()
    files.atomic_write(out_dir / PNG, png)
    # The report holds no environment values (no ray.env_vars, no connection); any registered secret that an
    # error message or a drift note carried in is redacted all the same.
    files.atomic_write(out_dir / HTML, redact(report.html(png)).encode())
    return {"png": out_dir / PNG, "html": out_dir / HTML}


def publish(run: Run, store, out_dir: Path | None = None) -> dict[str, str]:
    """Build and write a run's report, then put it in S3 beside the checkpoints with the run's metrics,
    events and record (what a report from S3 is rebuilt from). Returns local paths and S3 URIs.

    Without a store (a spec with no s3 section) the report is only written locally."""
    run_dir = run.dir
    run.folder.lease().fence("writing the run's report")  # an old DAG run's report never replaces the new run's
    report = build(run_dir, store=store, run=run.name, plan=ChunkPlan.from_spec(run.spec), spec=run.spec)
    paths = write(report, out_dir or default_out(run_dir))
    out = {"summary": redact(report.summary()), "html": str(paths["html"]), "png": str(paths["png"])}
    if store is None:
        return out
    history.publish(store, run.folder)
    with store.fenced(run.folder, "publishing the run's report") as w:
        out["png_uri"] = w.put_bytes(store.run_key(run.name, REPORT_DIR, PNG), paths["png"].read_bytes(), "image/png")
        out["html_uri"] = w.put_bytes(
            store.run_key(run.name, REPORT_DIR, HTML), paths["html"].read_bytes(), "text/html; charset=utf-8"
        )
    return out


def current_html(run: Run, store, back: str | None = None) -> str:
    """The run's report as it is now: from its folder where this process sees it, else from S3 (the
    Airflow UI's "Run report" link is served through this, so it never expires). `back`: the page to link back to."""
    run_dir = run.dir
    if (run_dir / layout.METRICS).is_file() or (run_dir / layout.EVENTS).is_file():
        report = build(run_dir, store=store, run=run.name, plan=ChunkPlan.from_spec(run.spec), spec=run.spec)
    elif store is not None:
        with tempfile.TemporaryDirectory(prefix="relay-report-") as tmp:
            report = from_s3(f"{store.uri}/{run}", Path(tmp), store.client)
    else:
        raise ReportError(
            f"run {run} has no metrics or events in {run_dir} and its spec publishes nowhere",
            "the report exists once a chunk of the run has trained",
        )
    return redact(report.html(report.plot_png(), back=back))


# ---------------------------------------------------------------------------------------- from S3
def from_s3(uri: str, workdir: Path, client=None) -> Report:
    """The report of a run published under s3://bucket/prefix/<run>: its metrics, events and record
    are downloaded into workdir (laid out as a run folder), its manifests read from the store."""

    bucket, key = parse_uri(uri)
    prefix, _, run = key.rpartition("/")
    if not run:
        raise ReportError(f"{uri} names no run", "give s3://BUCKET/PREFIX/RUN (as `checkpoint ls` lists them)")
    store = CheckpointStore(client or s3_client(), f"s3://{bucket}/{prefix}")
    run_dir = Path(workdir) / run
    got = history.fetch(store, run, run_dir)
    if layout.METRICS not in got and layout.EVENTS not in got:
        raise ReportError(
            f"no {layout.METRICS} or {layout.EVENTS} under {uri}/",
            "they are published with the report after each chunk's publish task; for a run "
            "published by hand, run `python -m relay report RUN_DIR` where its folder is",
        )
    return build(run_dir, store=store, run=run, source=uri)
