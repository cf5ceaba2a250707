"""Alert: one event a person must hear about, with what they need to act on it, in every channel's form.

Every alert carries the run, the DAG run, the chunk, the global step, what failed, the last valid
checkpoint and its S3 URI, what Relay did about it, and a link to the task log. The same record is
rendered as an e-mail (subject, HTML), a Slack message (text and blocks) and a JSON payload
(versioned, for webhooks), so all channels say the same thing.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import asdict, dataclass, field, replace
from dataclasses import fields as dc_fields
from datetime import UTC, datetime
from typing import Any

from relay.common.errors import CheckpointError, StoreError
from relay.common.redaction import redact
from relay.data.fingerprint import DataError
from relay.data.freeze import SourceDriftError
from relay.data.quality import DataQualityError
from relay.preflight.guard import DriftError

PAYLOAD_VERSION = 1

# kind -> (severity, headline). "error" kinds are failure events: they stay open until the run
# succeeds again, which sends one recovery message. Warnings tell of something Relay handled.
KINDS: dict[str, tuple[str, str]] = {
    "checkpoint_invalid": ("error", "checkpoint failed validation"),
    "data_quality": ("error", "training data failed its quality checks"),
    "data_drift": ("error", "training data changed under the run"),
    "settings_drift": ("error", "resume-critical settings changed"),
    "chunk_failed": ("error", "chunk failed; no more retries"),
    "publish_failed": ("error", "S3 publication failed after its retries"),
    "stall": ("error", "chunk stalled: no new step"),
    "task_failed": ("error", "task failed"),
    "retry": ("warning", "task failed; Airflow retries it"),
    "use_frozen": ("warning", "source data changed; training continues on the frozen copy"),
    "fallback": ("warning", "resumed from an older checkpoint"),
    "decision": ("warning", "a decision waits for you in the Airflow UI"),
    "deadline": ("warning", "the run will miss its deadline"),
    "resharded": ("warning", "the latest checkpoint was resharded to the spec's world size"),
    "world_size": ("warning", "the run's world size changed with its Ray cluster"),
    "capacity": ("warning", "a chunk waits for the Ray cluster's nodes"),
    "replay_divergence": ("warning", "a step trained again after a resume differs from its first try"),
    "recovered": ("ok", "run recovered"),
    "finished": ("ok", "run finished"),
}


def kind_of(error: BaseException, default: str = "task_failed") -> str:
    """The alert kind of an error; `default` for any other (imports local: these modules are heavier)."""

    for cls, kind in (
        (DataQualityError, "data_quality"),
        (SourceDriftError, "data_drift"),
        (DriftError, "settings_drift"),
        (CheckpointError, "checkpoint_invalid"),
        (DataError, "data_quality"),
        (StoreError, "publish_failed"),
    ):
        if isinstance(error, cls):
            return kind
    return default


@dataclass
class Alert:
    kind: str
    run: str
    what: str  # one line: what failed, in the words of the check that failed
    details: str = ""  # the check report, the failed expectations, the job's last log lines
    action: str = ""  # what Relay did (quarantined, fell back, stopped the job) and what to do next
    cause: str = ""  # a failed chunk's cause as classified (relay.runs.failure_cause): cause, step, signature
    spec: str = ""
    dag_id: str = ""
    dag_run: str = ""
    task: str = ""
    try_number: int | None = None
    chunk: int | None = None
    step: int | None = None
    last_valid_step: int | None = None
    last_valid_uri: str | None = None
    quarantined_to: str | None = None
    log_url: str = ""
    resolves: list[str] = field(default_factory=list)  # a recovery: the alerts it closes
    at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown alert kind {self.kind!r}; known: {', '.join(KINDS)}")

    @property
    def severity(self) -> str:
        return KINDS[self.kind][0]

    @property
    def headline(self) -> str:
        return KINDS[self.kind][1]

    def redacted(self) -> Alert:
        """This alert with every known secret (relay.common.redaction: Airflow's masked connections, ray.env_vars
        expanded from the environment) replaced by ***: what every channel, the ledger and the log get."""

        return replace(
            self,
            **{
                f.name: redact(getattr(self, f.name))
                for f in dc_fields(self)
                if isinstance(getattr(self, f.name), (str, list)) and f.name != "kind"
            },
        )

    # ------------------------------------------------------------------------------ rendering
    def subject(self) -> str:
        where = ", ".join(
            x
            for x in (f"chunk {self.chunk}" if self.chunk else "", f"step {self.step}" if self.step is not None else "")
            if x
        )
        return f"[relay {self.severity.upper()}] {self.run}: {self.headline}" + (f" ({where})" if where else "")

    @property
    def label(self) -> str:
        """What the alert's `what` is, by its kind: a failure's, a decision's, or news (a warning, a recovery)."""
        if self.kind == "decision":
            return "The question"
        return "What failed" if self.severity == "error" else "What happened"

    def fields(self) -> list[tuple[str, str]]:
        """The facts, in reading order; a fact Relay could not know says so instead of being dropped."""
        last = "none" if self.last_valid_step is None else f"step {self.last_valid_step}"
        last += f" ({self.last_valid_uri})" if self.last_valid_uri else " (not published to S3)"
        rows = [
            ("Run", self.run),
            (self.label, _plain(self.what)),
            *([("Cause", self.cause)] if self.cause else []),
            ("What Relay did", self.action or "-"),
            ("Chunk", str(self.chunk) if self.chunk else "-"),
            ("Global step", "-" if self.step is None else str(self.step)),
            ("Last valid checkpoint", last),
            ("DAG run", f"{self.dag_id} / {self.dag_run}" if self.dag_run else "-"),
            ("Task", f"{self.task} (try {self.try_number})" if self.task else "-"),
            ("Task log", self.log_url or "-"),
        ]
        if self.quarantined_to:
            rows.insert(3, ("Quarantined to", self.quarantined_to))
        if self.resolves:
            rows.insert(2, ("Resolves", "; ".join(self.resolves)))
        return rows

    def text(self) -> str:
        """Plain text (the task log): a decision's Markdown (**bold**, `code`) read as words."""
        body = "\n".join(f"{k}: {v}" for k, v in self.fields())
        return f"{self.subject()}\n{body}" + (f"\n\n{_plain(self.details)}" if self.details else "")

    def html(self) -> str:
        rows = "".join(f"<tr><th align='left'>{html.escape(k)}</th><td>{_link(v)}</td></tr>" for k, v in self.fields())
        details = f"<pre>{_marked_up(self.details)}</pre>" if self.details else ""
        return f"<h3>{html.escape(self.subject())}</h3><table>{rows}</table>{details}"

    def payload(self) -> dict:
        """The JSON body of a webhook post: every field, plus severity, headline and subject."""
        return {
            "relay_alert_version": PAYLOAD_VERSION,
            **asdict(self),
            "severity": self.severity,
            "headline": self.headline,
            "subject": self.subject(),
        }

    def slack(self) -> dict:
        """An incoming-webhook body: `text` (notifications, fallback) and Block Kit blocks."""
        facts = [{"type": "mrkdwn", "text": f"*{k}*\n{_mrkdwn(v)}"} for k, v in self.fields()]
        blocks: list[dict[str, Any]] = [{"type": "header", "text": {"type": "plain_text", "text": self.subject()[:150]}}]
        blocks += [{"type": "section", "fields": facts[i : i + 10]} for i in range(0, len(facts), 10)]
        if self.details and self.kind == "decision":  # Markdown facts: Slack's own bold and code
            blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": BOLD.sub(r"*\1*", self.details)[:2900]}})
        elif self.details:
            blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": f"```{self.details[:2900]}```"}})
        return {"text": self.subject(), "blocks": blocks}

    def to_json(self) -> str:
        return json.dumps(self.payload(), sort_keys=True)


BOLD = re.compile(r"\*\*(.+?)\*\*")
CODE = re.compile(r"`([^`]+)`")


def _plain(text: str) -> str:
    """Markdown's emphasis and code spans (what the Required Actions page renders) as plain words."""
    return CODE.sub(r"\1", BOLD.sub(r"\1", text))


def _marked_up(text: str) -> str:
    """Markdown's bold and code spans as HTML, the rest escaped."""
    return CODE.sub(r"<code>\1</code>", BOLD.sub(r"<b>\1</b>", html.escape(text)))


def _link(value: str) -> str:
    v = html.escape(value)
    return f"<a href='{v}'>{v}</a>" if value.startswith(("http://", "https://")) else v


def _mrkdwn(value: str) -> str:
    return f"<{value}|task log>" if value.startswith(("http://", "https://")) else value[:1900]
