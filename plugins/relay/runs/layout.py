"""verl's on-disk checkpoint layout (FSDP), and Relay's own corner of a run folder.

    <run_dir>/                                   verl's trainer.default_local_dir
      latest_checkpointed_iteration.txt          the tracker: text "N"
      global_step_N/
        data.pt                                  StatefulDataLoader state
        actor/model_world_size_W_rank_R.pt       one of each per rank
        actor/optim_world_size_W_rank_R.pt
        actor/extra_state_world_size_W_rank_R.pt lr_scheduler + RNG states
        actor/fsdp_config.json                   {"FSDP_version": 1|2, "world_size": W}
        actor/huggingface/config.json            (+ tokenizer, generation config)
        critic/...                               alike, when the algorithm has a critic
      metrics.jsonl, events.jsonl                Relay: one row per step; chunk attempts and resumes
      hf/global_step_N/                          Relay: Hugging Face exports (milestones, the final step)
      .relay/                                    Relay: run record, lease, staging, quarantine,
                                                 superseded, rollout_state, report

verl writes the tracker with a plain write (no temp file, no fsync); Relay writes it atomically.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from relay.common import files
from relay.common.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_([0-9]{1,18})\Z")
STEP_NUMBER = re.compile(r"[0-9]{1,18}")
TRACKER_MAX_BYTES = 64
SHARD = re.compile(r"^(model|optim|extra_state)_world_size_([0-9]+)_rank_([0-9]+)\.pt\Z")
SHARD_KINDS = ("model", "optim", "extra_state")
ROLES = ("actor", "critic")
RELAY_DIR = ".relay"
METRICS = "metrics.jsonl"
EVENTS = "events.jsonl"
HF_DIR = "hf"


def step_name(step: int) -> str:
    """verl's name of a step's checkpoint folder (in a run folder, a staging folder, S3, hf/)."""
    return f"global_step_{step}"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / step_name(step)


def shard_name(kind: str, world_size: int, rank: int) -> str:
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def relay_dir(run_dir: Path, *parts: str) -> Path:
    return Path(run_dir, RELAY_DIR, *parts)


def tracker_path(run_dir: Path) -> Path:
    return Path(run_dir) / TRACKER


def read_tracker(run_dir: Path) -> int | None:
    """The step the tracker names, or None without a tracker. Garbage in the tracker is an error."""
    path = tracker_path(run_dir)
    try:
        with open(path, "rb") as f:
            raw = f.read(TRACKER_MAX_BYTES + 1)  # a step number is short: never read a huge file whole
    except FileNotFoundError:
        return None
    except OSError as e:  # a folder, or unreadable
        raise CheckpointError(
            f"tracker {path} cannot be read ({e.strerror or e})",
            f"move it aside; `python -m relay checkpoint validate {run_dir}` finds the newest valid checkpoint",
        ) from None
    text = raw.decode("utf-8", "replace").strip()
    # ASCII digits only: str.isdigit() also accepts '²' or '١', which int() refuses or reads as another number.
    if len(raw) > TRACKER_MAX_BYTES or not STEP_NUMBER.fullmatch(text):
        raise CheckpointError(
            f"tracker {path} holds {text[:40]!r}, not a step number (a half-written or corrupted tracker)",
            f"run `python -m relay checkpoint validate {run_dir}` to find the newest valid checkpoint",
        )
    return int(text)


def write_tracker(run_dir: Path, step: int) -> None:
    """Point the tracker at `step`: temp file, fsync, rename, fsync the folder. Never half-written."""
    files.atomic_write(tracker_path(run_dir), str(step).encode())


def step_dirs(run_dir: Path) -> dict[int, Path]:
    """Every global_step_N folder of a run, by step."""
    out: dict[int, Path] = {}
    if Path(run_dir).is_dir():
        for p in Path(run_dir).iterdir():
            m = STEP_DIR.match(p.name)
            if m and p.is_dir():
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def checkpoint_reached(run_dir: Path | str, step: int) -> bool:
    """The tracker names `step` or later, and global_step_<step> is there (cheap: two stats and a read)."""
    tracker = read_tracker(Path(run_dir))
    return tracker is not None and tracker >= step and step_dir(Path(run_dir), step).is_dir()


def is_rotation_leftover(path: Path) -> bool:
    """verl's rotation deletes actor/ and critic/ but leaves global_step_N/ (empty, or holding data.pt)."""
    names = {p.name for p in Path(path).iterdir()} if Path(path).is_dir() else set()
    return not (names & set(ROLES)) and names <= {"data.pt"}


def read_fsdp_config(role_dir: Path) -> dict[str, Any] | None:
    p = Path(role_dir) / "fsdp_config.json"
    try:
        config: dict[str, Any] = json.loads(p.read_text())
        return config
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise CheckpointError(
            f"{p} is not valid JSON ({e})", "the checkpoint is corrupt; resume from an older one"
        ) from None
