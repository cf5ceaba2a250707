"""AlertLedger: which alerts a run has sent, so that one failure event makes one alert.

A small versioned record beside the run (`<run>/.relay/alerts.json`), changed under an fcntl lock:
the task's own alert and Airflow's failure callback for the same try, or each retry of a stalled
chunk, find the event already claimed. Failure alerts stay open until the run succeeds again; the
recovery message closes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from relay.alerts.alert import Alert
from relay.common import files
from relay.common.filelock import file_lock
from relay.runs import layout

VERSION = 1


class AlertLedger:
    def __init__(self, run_dir: Path):
        self.path = layout.relay_dir(run_dir, "alerts.json")
        self._lock_path = layout.relay_dir(run_dir, "alerts.lock")

    @contextmanager
    def _locked(self) -> Iterator[dict]:
        with file_lock(self._lock_path, "updating the alert ledger"):
            record = self._read()
            yield record
            files.atomic_write_json(self.path, record)

    def _read(self) -> dict:
        try:
            record = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"version": VERSION, "alerts": []}
        except ValueError:  # a torn or hand-edited record: start a new one, keep the old aside
            self.path.rename(self.path.with_suffix(".json.unreadable"))
            return {"version": VERSION, "alerts": []}
        if record.get("version") != VERSION:
            raise ValueError(f"{self.path}: alert ledger version {record.get('version')}, expected {VERSION}")
        return record

    def entries(self) -> list[dict]:
        return self._read()["alerts"] if self.path.exists() else []

    def claim(self, key: str, alert: Alert) -> bool:
        """Record the event `key` as alerted; False when it already was (then send nothing)."""
        with self._locked() as record:
            if any(e["key"] == key for e in record["alerts"]):
                return False
            record["alerts"].append(
                {
                    "key": key,
                    "kind": alert.kind,
                    "severity": alert.severity,
                    "at": alert.at,
                    "dag_run": alert.dag_run,
                    "task": alert.task,
                    "try": alert.try_number,
                    "chunk": alert.chunk,
                    "step": alert.step,
                    "what": alert.what[:300],
                    "open": alert.severity == "error",
                    "delivered": {},
                }
            )
            return True

    def delivered(self, key: str, results: dict[str, str]) -> None:
        """What each channel did with the alert (for `doctor` and people reading the record)."""
        with self._locked() as record:
            for e in record["alerts"]:
                if e["key"] == key:
                    e["delivered"] = results

    def first_unconfigured(self, channel: str) -> bool:
        """Whether this is the first time the run met `channel` unconfigured (remembered: said once per run)."""
        with self._locked() as record:
            said = record.setdefault("unconfigured", [])
            if channel in said:
                return False
            said.append(channel)
            return True

    def alerted_in_try(self, dag_run: str, task: str, try_number: int | None) -> bool:
        """Whether this try of the task already sent a failure alert of its own (a warning it sent, a fallback or a
        decision, does not count: its failure is still to be told)."""
        return any(
            e["dag_run"] == dag_run and e["task"] == task and e["try"] == try_number and e.get("severity") == "error"
            for e in self.entries()
        )

    def open_failures(self) -> list[dict]:
        return [e for e in self.entries() if e["open"]]

    def close(self, keys: list[str]) -> None:
        with self._locked() as record:
            for e in record["alerts"]:
                if e["key"] in keys:
                    e["open"] = False
