"""A training run's folder as one value: its name (the last part of its S3 prefix), its path (verl's
trainer.default_local_dir) and the life of the run it holds.

The run's name and folder travel together, so that a name is never paired with another run's folder, and the
lease is built in one place with the incarnation it fences for (relay.runs.lease).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relay.runs.lease import Lease
from relay.runs.metrics import record_event


@dataclass(frozen=True)
class RunFolder:
    name: str
    path: Path
    incarnation: str | None = None  # None: not known yet (relay.runs.run.Run.incarnation)

    def lease(self) -> Lease:
        """The run's lease, its tokens bound to this folder's incarnation."""
        return Lease(self.path, incarnation=self.incarnation)

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """A run event written for this folder's incarnation, by a writer without a token (Lease.fence): refused,
        and nothing written, once the run was started again. The event names the incarnation it was written for."""
        self.lease().fence(f"the event {event}")
        return record_event(self.path, event, **({"incarnation": self.incarnation} if self.incarnation else {}), **fields)

    def __str__(self) -> str:
        return self.name
