"""A checkpoint's manifest: a small versioned record of what a validated checkpoint holds.

global_step_N/relay_manifest.json lists every file with its size and CRC64NVME, the step, world
size and FSDP version, parameter names with their global shapes, the run's settings fingerprint,
its incarnation, the verl version and what the step's commit record says of its certificate. It is
written once the checkpoint has passed validation, published to S3 after every file, and re-checked
just before a resume loads the files.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from relay import __version__
from relay.checkpoints import integrity
from relay.common import files
from relay.common.errors import CheckpointError
from relay.common.timestamps import utc_now
from relay.runs.record import LEGACY_INCARNATION, is_incarnation

NAME = "relay_manifest.json"
# 2: `incarnation`, the life of the run that wrote the checkpoint (relay.runs.record); a version-1 manifest is of
# incarnation "1". 3: `resharded_from` ({world_size, manifest_sha256} of the original, or null:
# relay.checkpoints.reshard). 4: `skipped` ({level: why} of the levels that did not run; `checks` lists only those
# that ran). 5 (this Relay): `certificate`, what the step's commit record says (relay.checkpoints.commits: the
# certificate's sha256, or "skipped: <why>"; null before commit records). Readers accept every version in READS.
VERSION = 5
READS = (1, 2, 3, 4, 5)


@dataclass
class Manifest:
    run: str
    step: int
    world_size: int
    fsdp_version: int | None
    files: dict[str, dict[str, Any]]  # relative path -> {"size": int, "crc64nvme": base64}
    params: dict[str, list[Any]]  # parameter name -> [global shape..., dtype]
    settings_fingerprint: str | None = None
    verl_version: str | None = None
    relay_version: str = __version__
    created_at: str = field(default_factory=utc_now)
    checks: list[str] = field(default_factory=list)  # the levels that ran and passed
    skipped: dict[str, str] = field(default_factory=dict)  # the levels that did not run, and why
    incarnation: str = LEGACY_INCARNATION
    resharded_from: dict[str, Any] | None = None
    certificate: str | None = None  # the commit record's: its certificate's sha256, or "skipped: <why>"
    version: int = VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "manifest") -> Manifest:
        """Parse and check a manifest read back from disk or S3: a malformed one is a CheckpointError, and
        every file it names must be a plain relative path (a manifest naming "../x" is refused)."""
        fix = "re-validate the checkpoint to rewrite it (`python -m relay checkpoint validate RUN_DIR --quarantine`)"
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as e:  # json raises RecursionError on very deep nesting
            raise CheckpointError(f"{where} is not valid JSON ({str(e)[:200]})", fix) from None
        if not isinstance(d, dict) or d.get("version") not in READS or isinstance(d.get("version"), bool):
            got = _short(d.get("version")) if isinstance(d, dict) else f"? (a JSON {type(d).__name__}, not an object)"
            raise CheckpointError(f"{where} has version {got}, this Relay reads versions {', '.join(map(str, READS))}", fix)
        try:
            m = cls(**d)
        except TypeError as e:
            raise CheckpointError(f"{where} is malformed ({str(e)[:200]})", fix) from None
        if problem := _problem(m):
            raise CheckpointError(f"{where} is malformed: {problem}", fix)
        return m

    def write(self, step_dir: Path) -> Path:
        path = Path(step_dir) / NAME
        files.atomic_write(path, self.to_json().encode())
        return path


def _is_int(v: object, least: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _problem(m: Manifest) -> str | None:
    """What is wrong with a parsed manifest's fields, or None."""
    if not isinstance(m.run, str):
        return f"run is {_short(m.run)}, not a name"
    if not _is_int(m.step):
        return f"step is {_short(m.step)}, not a step number"
    if not _is_int(m.world_size, 1):
        return f"world_size is {_short(m.world_size)}, not a positive number"
    if m.fsdp_version is not None and not _is_int(m.fsdp_version):
        return f"fsdp_version is {_short(m.fsdp_version)}"
    if not is_incarnation(m.incarnation):
        return f"incarnation is {_short(m.incarnation)}, not an incarnation id"
    if m.resharded_from is not None and not (
        isinstance(m.resharded_from, dict) and _is_int(m.resharded_from.get("world_size"), 1)
    ):
        return f"resharded_from is {_short(m.resharded_from)}, not {{world_size, manifest_sha256}}"
    if not isinstance(m.files, dict) or not isinstance(m.params, dict) or not isinstance(m.checks, list):
        return "files, params or checks has the wrong type"
    if m.certificate is not None and not isinstance(m.certificate, str):
        return f"certificate is {_short(m.certificate)}, not a digest or why it was skipped"
    if not isinstance(m.skipped, dict):
        return f"skipped is {_short(m.skipped)}, not {{level: why}}"
    for rel, f in m.files.items():
        if problem := files.relpath_problem(rel):
            return f"the file {_short(rel)} is refused: {problem}"
        if not (isinstance(f, dict) and _is_int(f.get("size")) and isinstance(f.get("crc64nvme"), str)):
            return f"the entry of {_short(rel)} is {_short(f)}, not {{size, crc64nvme}}"
    return None


def path_of(step_dir: Path) -> Path:
    return Path(step_dir) / NAME


def read(step_dir: Path) -> Manifest | None:
    p = path_of(step_dir)
    try:
        text = p.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"{p} cannot be read ({e.strerror or e})", "re-validate the checkpoint") from None
    return Manifest.from_json(text, str(p))


def checkpoint_files(step_dir: Path) -> list[str]:
    """Every file of a checkpoint folder, relative, sorted; the manifest itself excluded."""
    step_dir = Path(step_dir)
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file() and p.name != NAME)


def verl_version() -> str | None:
    try:
        return version("verl")
    except PackageNotFoundError:
        return None


def unchanged_since_validation(step_dir: Path, under: str = "") -> None:
    """The files under `under` are byte for byte those the gate proved safe (its manifest's sizes and
    CRC64NVME, zip CRCs), read just before a loader that unpickles (verl's) gets them; else CheckpointError."""
    m = read(step_dir)
    if m is None:
        raise CheckpointError(
            f"{step_dir} has no {NAME}: it never passed validation, so verl's loader must not read it",
            f"run `python -m relay checkpoint validate {step_dir.parent} --quarantine` first",
        )
    recorded = {rel for rel in m.files if rel.startswith(under)}
    present = {rel for rel in checkpoint_files(step_dir) if rel.startswith(under)}
    changed = sorted(recorded ^ present)
    for rel in sorted(recorded & present):
        scan = integrity.scan(step_dir / rel)
        if scan.problem or scan.size != m.files[rel]["size"] or scan.crc64nvme != m.files[rel]["crc64nvme"]:
            changed.append(rel)
    if changed:
        raise CheckpointError(
            f"{step_dir}: {', '.join(changed[:5])} changed since validation; verl's loader "
            "(which unpickles) is not run on it",
            "validate the checkpoint again (`python -m relay checkpoint validate RUN_DIR --quarantine`)",
        )
