"""A checkpoint's manifest: a small versioned record of what a validated checkpoint holds.

global_step_N/relay_manifest.json lists every file with its size and CRC64NVME, the step, world
size and FSDP version, parameter names with their global shapes, the run's settings fingerprint
and the verl version. It is written once the checkpoint has passed validation, published to S3
after every file, and re-checked just before a resume loads the files.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay import __version__, layout
from relay.errors import CheckpointError

NAME = "relay_manifest.json"
VERSION = 1


@dataclass
class Manifest:
    run: str
    step: int
    world_size: int
    fsdp_version: int | None
    files: dict[str, dict]  # relative path -> {"size": int, "crc64nvme": base64}
    params: dict[str, list]  # parameter name -> [global shape..., dtype]
    settings_fingerprint: str | None = None
    verl_version: str | None = None
    relay_version: str = __version__
    created_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    checks: list[str] = field(default_factory=list)
    version: int = VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f["size"] for f in self.files.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "manifest") -> "Manifest":
        try:
            d = json.loads(text)
        except ValueError as e:
            raise CheckpointError(f"{where} is not valid JSON ({e})", "re-validate the checkpoint to rewrite it")
        if not isinstance(d, dict) or d.get("version") != VERSION:
            raise CheckpointError(f"{where} has version {d.get('version') if isinstance(d, dict) else '?'}, "
                                  f"this Relay reads version {VERSION}", "re-validate the checkpoint to rewrite it")
        try:
            m = cls(**d)
            if not isinstance(m.step, int) or not isinstance(m.files, dict) or not all(
                    isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("crc64nvme"), str)
                    for v in m.files.values()):
                raise TypeError("malformed fields")
            return m
        except TypeError as e:
            raise CheckpointError(f"{where} is malformed ({e})", "re-validate the checkpoint to rewrite it") from None

    def write(self, step_dir: Path) -> Path:
        path = Path(step_dir) / NAME
        layout.atomic_write(path, self.to_json().encode())
        return path


def path_of(step_dir: Path) -> Path:
    return Path(step_dir) / NAME


def read(step_dir: Path) -> Manifest | None:
    p = path_of(step_dir)
    try:
        text = p.read_text()
    except FileNotFoundError:
        return None
    return Manifest.from_json(text, str(p))


def checkpoint_files(step_dir: Path) -> list[str]:
    """Every file of a checkpoint folder, relative, sorted; the manifest itself excluded."""
    step_dir = Path(step_dir)
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file() and p.name != NAME)


def verl_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("verl")
    except PackageNotFoundError:
        return None
