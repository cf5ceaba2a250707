"""What the Ray head fault cases (tests/faults/test_ray_head_*.py) share: a run spec whose trainer pauses
once after step 8 at a fault point, so the head dies exactly mid-chunk, between checkpoints 6 and 9;
and the check that a run finished as if nothing had happened."""

from __future__ import annotations

from pathlib import Path

from conftest import assert_bitwise_equal, model_state, read_metrics, write_spec
from relay import layout
from relay.metrics import read_events

STEPS, PAUSED_AFTER, RESUMED_FROM = 12, 8, 6


def spec_for(folder: Path, name: str, marker: Path, **overrides) -> Path:
    """One chunk of 12 steps, saving every 3; its trainer pauses once after step 8 until marker.go exists."""
    return write_spec(folder, name=name, chunk_steps=STEPS, **{
        "trainer.settings.save_freq": 3,
        "ray.env_vars": {"RELAY_FAULT_PAUSE_AT": f"after_step@{PAUSED_AFTER}", "RELAY_FAULT_ONCE": str(marker),
                         "RELAY_FAULT_PAUSE_S": "300"}, **overrides})


def finished_as_uninterrupted(run_dir: Path, baseline: dict, out: str) -> list[tuple[int, int]]:
    assert layout.read_tracker(run_dir) == STEPS, out[-5000:]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, STEPS + 1)), "each step once"
    assert_bitwise_equal(model_state(run_dir / f"global_step_{STEPS}"), baseline)
    return [(e["resumed_from"], e["lease_token"]) for e in read_events(run_dir) if e["event"] == "chunk_start"]
