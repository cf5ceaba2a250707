"""A training run's folder as one value: its name (the last part of its S3 prefix), its path (verl's
trainer.default_local_dir) and the life of the run it holds, and where Relay keeps each record in it.

The run's name and folder travel together from here on, so that a name is never paired with another run's
folder, and the lease is built in one place with the incarnation it fences for (relay.runs.lease).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relay.runs import layout
from relay.runs.lease import Lease
from relay.runs.record import RECORD


@dataclass(frozen=True)
class RunFolder:
    name: str
    path: Path
    incarnation: str | None = None  # None: not known yet (relay.runs.run.Run.incarnation)

    def lease(self) -> Lease:
        """The run's lease, its tokens bound to this folder's incarnation."""
        return Lease(self.path, incarnation=self.incarnation)

    def relay(self, *parts: str) -> Path:
        """Relay's own corner of the folder: `.relay/<parts>`."""
        return layout.relay_dir(self.path, *parts)

    @property
    def tracker(self) -> Path:
        return layout.tracker_path(self.path)

    @property
    def metrics(self) -> Path:
        return self.path / layout.METRICS

    @property
    def events(self) -> Path:
        return self.path / layout.EVENTS

    @property
    def record(self) -> Path:
        return self.relay(RECORD)

    def step_dir(self, step: int) -> Path:
        return layout.step_dir(self.path, step)

    def __str__(self) -> str:
        return self.name
