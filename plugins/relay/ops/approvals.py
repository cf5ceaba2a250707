"""What a person is asked, and what they answered: plain values a task hands to Airflow's human-in-the-loop
(relay.airflow.decisions) and reads back."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Decision:
    """What a person is asked: a headline, the facts (Markdown), the options, and which of them go on."""

    kind: str  # fresh_start | drift | fallback
    subject: str
    body: str
    options: list[str]
    proceed: list[str]  # the options that go on; any other stops the DAG run
    data: dict[str, Any] = field(default_factory=dict)  # what the task needs to act on the answer; "run": its name

    def to_dict(self) -> dict:
        """The decision as the HITL detail's task kwargs carry it."""
        return asdict(self)


@dataclass
class Answer:
    """A person's answer: the option chosen, by whom, when, and the decision's data."""

    kind: str
    chosen: str
    by: str
    at: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The answer as a plain mapping."""
        return asdict(self)

    def who(self) -> str:
        """Who answered and when, in a log's words."""
        return f"{self.by} in the Airflow UI at {self.at}"
