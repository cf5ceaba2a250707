"""The reshard record of a step folder (relay_resharded.json): the world size a reshard wrote the step at, and
the manifest it wrote, which validation checks the step against. Its own module, below both the reshard and
validation, so that each reads it without importing the other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from relay.common.errors import CheckpointError

RECORD = "relay_resharded.json"


def record_of(step_dir: Path) -> dict[str, Any] | None:
    """The reshard record of a step folder ({world_size, manifest_sha256, ...}), or None."""
    try:
        d = json.loads((Path(step_dir) / RECORD).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{Path(step_dir) / RECORD} cannot be read ({e})",
            "reshard the step again from its original in .relay/resharded/",
        ) from None
    if not isinstance(d, dict) or not isinstance(d.get("world_size"), int) or d["world_size"] < 1:
        raise CheckpointError(
            f"{Path(step_dir) / RECORD} is malformed: {str(d)[:120]}",
            "reshard the step again from its original in .relay/resharded/",
        )
    return d
