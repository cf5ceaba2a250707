"""The training run as one value: its spec, its name, its folder and its incarnation.

A trigger, a CLI command or a chunk request names a run once; everything after that receives this value
rather than a spec and a bare name, so the run's folder (verl's trainer.default_local_dir) is worked out
in one place and the name a person typed in the trigger form reaches the trainer unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from relay.runs.folder import RunFolder
from relay.spec.run_spec import RunSpec


@dataclass(frozen=True)
class Run:
    spec: RunSpec
    name: str  # checked against RUN_NAME_PATTERN when built with Run.of
    dir: Path  # <spec.checkpoint_dir>/<name>
    # The life of the run this value speaks for (relay.runs.record): as the trigger found or began it, or
    # as the folder's record says. None: not known yet (a run before its first trigger, or a value built
    # only to read files); no checkpoint is restored from S3 for such a run.
    incarnation: str | None = None

    @classmethod
    def of(cls, spec: RunSpec, name: str | None = None, incarnation: str | None = None) -> Run:
        """The run `name` of `spec` (the spec's own run when no name is given)."""
        name = name or spec.name
        return cls(spec, name, spec.run_dir(name), incarnation)

    @property
    def folder(self) -> RunFolder:
        """The run's folder: its name and path together, and the lease of its incarnation."""
        return RunFolder(self.name, self.dir, self.incarnation)

    def __str__(self) -> str:
        return self.name
