"""A training run's folder as one value: its name (the last part of its S3 prefix), its path (verl's
trainer.default_local_dir) and the life of the run it holds.

The run's name and folder travel together, so that a name is never paired with another run's folder, and the
lease is built in one place with the incarnation it fences for (relay.runs.lease).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relay.runs.lease import Lease


@dataclass(frozen=True)
class RunFolder:
    name: str
    path: Path
    incarnation: str | None = None  # None: not known yet (relay.runs.run.Run.incarnation)

    def lease(self) -> Lease:
        """The run's lease, its tokens bound to this folder's incarnation."""
        return Lease(self.path, incarnation=self.incarnation)

    def __str__(self) -> str:
        return self.name
