"""What a person does to a run's checkpoints from a terminal (`relay checkpoint ...`), given the run's folder or
its S3 prefix: validate, gate, publish, restore, reshard, list and inspect. Each returns what the command prints.

The same parts as the DAG's: the gate (relay.checkpoints.gate), the store (relay.s3.store), the restore that takes
the run's lease as a writer (relay.s3.restore), the reshard that the gate then admits (relay.checkpoints.reshard).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relay.checkpoints import preview
from relay.checkpoints.gate import Admission, admit_dir
from relay.checkpoints.reshard import ReshardResult
from relay.checkpoints.validate import CheckReport, validate_checkpoint
from relay.runs import layout
from relay.runs.folder import RunFolder
from relay.runs.lease import take_for_operator
from relay.runs.record import folder_incarnation, read_record
from relay.s3 import history
from relay.s3.restore import restore as restore_published
from relay.s3.store import CheckpointStore, parse_uri

NO_CHECKPOINT = f"no {layout.TRACKER}, no global_step_N folder"  # what a folder a checkpoint command refuses lacks


def holds_checkpoint(folder: Path) -> bool:
    """Whether `folder` is a global_step_N folder, or holds a tracker or one: something a checkpoint command examines."""
    is_step = lambda p: layout.STEP_DIR.match(p.name) is not None  # noqa: E731
    return is_step(folder) or (folder / layout.TRACKER).exists() or any(is_step(c) for c in folder.iterdir())


def spec_source(run_dir: Path) -> str | None:
    """The spec the run was started from, as its run record names it (None: no record names one)."""
    source = read_record(run_dir).get("spec_source")
    return str(source) if source else None


def validate(run_dir: Path, step: int | None, *, quick: bool, smoke_spec: Any = None) -> CheckReport:
    """Every level of validation but the smoke check (`quick`: structure, consistency and integrity only): without
    the safe load and the numerics, a checkpoint with NaN weights, or a pickle that would run code, would pass.
    With `smoke_spec`, also the forward pass of that spec's model on the weights."""
    smoke = None
    if smoke_spec is not None:
        from relay.preflight.admission import smoke_check

        checks = smoke_spec.checkpoints.model_copy(update={"smoke": True})
        smoke = smoke_check(smoke_spec.model_copy(update={"checkpoints": checks}))
    return validate_checkpoint(run_dir, step, upto="integrity" if quick else "numerics", smoke=smoke)


def gate(run_dir: Path, step: int | None = None) -> Admission:
    """The DAG's gate on a folder: every level; the manifest written if valid, else the step quarantined and the
    tracker pointed at the newest valid checkpoint."""
    return admit_dir(run_dir, step)


@dataclass
class Published:
    """A publication from a folder: the gate's admission, and the store's result when it admitted the step."""

    step: int
    admission: Admission
    result: Any = None  # relay.s3.store's PublishResult

    def describe(self) -> str:
        """What was published, in the command's words."""
        r = self.result
        return (
            f"published {r.uri}: {len(r.uploaded)} files uploaded ({r.bytes_uploaded} bytes), "
            f"{len(r.skipped)} already there, {r.aborted_uploads} stale uploads aborted, "
            f"{r.seconds:.1f}s; latest {'-> ' + str(self.step) if r.latest_moved else 'unchanged'}"
        )


class NoStep(ValueError):
    """No step was given and the folder has no tracker to name one."""


def publish(run_dir: Path, step: int | None, store: CheckpointStore, *, run: str | None = None) -> Published:
    """Publish a folder's step (default: the tracker's) after the gate admits it: only a checkpoint proven whole is
    published, for the incarnation the folder holds now (a fresh start meanwhile takes back what this wrote)."""
    step = step or layout.read_tracker(run_dir)
    if step is None:
        raise NoStep(f"{run_dir} has no tracker: give --step")
    admission = admit_dir(run_dir, step)
    if not admission.ok:
        return Published(step, admission)
    folder = RunFolder(run or run_dir.name, run_dir, folder_incarnation(run_dir))
    result = store.publish(folder, step)
    history.publish(store, folder)
    return Published(step, admission, result)


def restore(
    store: CheckpointStore, run_dir: Path, *, run: str | None = None, step: int | None = None, force: bool = False
) -> tuple[int, str] | None:
    """Restore the newest valid published checkpoint (at or below `step`) into the folder, under the run's lease
    taken as an operator (refused while its trainer is alive on this host, unless `force`): (step, its URI), or
    None when nothing valid is published."""
    token = take_for_operator(run_dir, "relay checkpoint restore", force=force)
    return restore_published(store, RunFolder(run or run_dir.name, run_dir), step=step, token=token)


@dataclass
class Resharded:
    """A reshard and the gate's admission of the step it wrote."""

    result: ReshardResult
    admission: Admission

    def to_dict(self) -> dict[str, Any]:
        """The reshard's record, with the gate's verdict."""
        return {**self.result.to_dict(), "valid": self.admission.ok, "validation": self.admission.explain()}


def reshard(run_dir: Path, world_size: int, *, step: int | None = None, out: Path | None = None) -> Resharded:
    """Write a step at another world size (in place, the original kept, or into the run folder `out`), then the
    gate on the new step, as on a trainer's save: every level; its manifest records the reshard."""
    from relay.checkpoints.reshard import reshard as reshard_step

    result = reshard_step(run_dir, world_size, step=step, out=out)
    return Resharded(result, admit_dir(out or run_dir, result.step))


@dataclass
class PublishedStep:
    """One published step of a run, as `relay checkpoint ls` lists it."""

    run: str
    step: int
    published: bool  # its manifest is there (else an incomplete upload)
    latest: bool
    bytes: int | None
    files: int | None
    uri: str

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON."""
        return asdict(self)


def published(store: CheckpointStore, run: str | None = None) -> list[PublishedStep]:
    """Every published step of one run, or of every run under the store's prefix."""
    rows = []
    for name in [run] if run else store.runs():
        latest = (store.latest(name) or {}).get("step")
        for step in store.steps(name):
            m = store.manifest(name, step)
            rows.append(
                PublishedStep(
                    name,
                    step,
                    m is not None,
                    step == latest,
                    m.total_bytes if m else None,
                    len(m.files) if m else None,
                    store.step_uri(name, step),
                )
            )
    return rows


class NotARun(ValueError):
    """An S3 URI that names no run."""


def inspect(source: str, step: int | None, store_at) -> preview.ResumePreview:
    """What a resume would load from a run folder, a global_step_N folder, or s3://BUCKET/PREFIX/RUN[/global_step_N]
    (`store_at(uri)`: the store of an S3 prefix); nothing is unpickled."""
    if not source.startswith("s3://"):
        return preview.inspect_dir(Path(source), step)
    bucket, key = parse_uri(source)
    parts = key.rstrip("/").split("/")
    if parts and parts[-1].startswith("global_step_"):
        step, parts = step or int(parts[-1].removeprefix("global_step_")), parts[:-1]
    if not parts or not parts[-1]:
        raise NotARun("give s3://BUCKET/PREFIX/RUN[/global_step_N]")
    return preview.inspect_uri(store_at(f"s3://{bucket}/{'/'.join(parts[:-1])}"), parts[-1], step)
