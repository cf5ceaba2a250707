"""What the Ray head fault cases (tests/faults/test_ray_head_*.py) share: a run spec whose trainer pauses
once after step 8 at a fault point, so the head dies exactly mid-chunk, between checkpoints 6 and 9;
and the check that a run finished as if nothing had happened."""

from __future__ import annotations

from pathlib import Path

from relay.runs.metrics import read_events
from support.faults import assert_finished_as
from support.helpers import write_spec

STEPS, PAUSED_AFTER, RESUMED_FROM = 12, 8, 6


def spec_for(folder: Path, name: str, marker: Path, **overrides) -> Path:
    """One chunk of 12 steps, saving every 3; its trainer pauses once after step 8 until marker.go exists."""
    return write_spec(
        folder,
        name=name,
        chunk_steps=STEPS,
        **{
            "trainer.settings.save_freq": 3,
            "ray.env_vars": {
                "RELAY_FAULT_PAUSE_AT": f"after_step@{PAUSED_AFTER}",
                "RELAY_FAULT_ONCE": str(marker),
                "RELAY_FAULT_PAUSE_S": "300",
            },
            **overrides,
        },
    )


def finished_as_uninterrupted(run_dir: Path, baseline: dict, out: str) -> list[tuple[int, int]]:
    """Finished as uninterrupted; each attempt's (resumed_from, lease token)."""
    assert_finished_as(run_dir, baseline, STEPS, out)
    return [(e["resumed_from"], e["lease_token"]) for e in read_events(run_dir) if e["event"] == "chunk_start"]
