"""The kill matrix of tests/faults/test_kill_points.py: every (phase, step, handoff) case where a trainer can be
killed in a 12-step run of two chunks saving every 3 steps, and which of them a test run tries.

CI tries a sample drawn with RELAY_TEST_SEED (default: the checked-out commit, so each CI run of a new commit tries
other cases): one case of every phase, both handoffs among them; any case of the matrix can be drawn. The faults
lane tries them all. RELAY_KILL_POINTS names cases by their ids (`before_rename@6`, `after_step@9-warm`) to replay
them."""

from __future__ import annotations

import os
import random
import subprocess

import pytest

from relay.common.faultpoint import FAULT_PHASES
from support.helpers import ROOT

STEPS, CHUNK, SAVE_FREQ = 12, 6, 3
WARM = "-warm"  # a case id's suffix: the kill lands in a job that went on warm into chunk 2

Case = tuple[str, int, bool]  # (phase, step, warm)


def seed() -> int:
    """RELAY_TEST_SEED, else the checked-out commit's first 32 bits."""
    if os.environ.get("RELAY_TEST_SEED"):
        return int(os.environ["RELAY_TEST_SEED"])
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return int(head[:8], 16)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def matrix() -> list[Case]:
    """Every case: each phase at each step it can reach, under a cold handoff; and again under a warm one where the
    step is in chunk 2, the chunk chunk 1's job went on into."""
    saves = range(SAVE_FREQ, STEPS + 1, SAVE_FREQ)
    cold = [(phase, s) for s in saves for phase in FAULT_PHASES if phase != "after_step"]
    cold += [("after_step", s) for s in range(1, STEPS + 1)]
    return [(p, s, False) for p, s in cold] + [(p, s, True) for p, s in cold if s > CHUNK]


def case_id(case: Case) -> str:
    phase, step, warm = case
    return f"{phase}@{step}{WARM if warm else ''}"


def sample(rng_seed: int) -> list[Case]:
    """One case of every phase, at least one of them under each handoff, drawn with rng_seed."""
    every = matrix()
    rng = random.Random(rng_seed)
    chosen = [rng.choice([c for c in every if c[0] == phase]) for phase in FAULT_PHASES]
    for warm in (True, False):  # both handoffs: one phase's case drawn again under the missing one
        if not any(c[2] == warm for c in chosen):
            i = rng.randrange(len(chosen))
            chosen[i] = rng.choice([c for c in every if c[0] == chosen[i][0] and c[2] == warm])
    return ordered(chosen)


def named(ids: str) -> list[Case]:
    """The cases a comma-separated list of ids names; a usage error naming the ids that exist otherwise."""
    by_id = {case_id(c): c for c in matrix()}
    wanted = [x.strip() for x in ids.split(",") if x.strip()]
    if unknown := [w for w in wanted if w not in by_id]:
        raise pytest.UsageError(f"RELAY_KILL_POINTS: no case {', '.join(unknown)}; the cases are {', '.join(by_id)}")
    return ordered([by_id[w] for w in wanted])


def chosen(whole: bool, rng_seed: int) -> list[Case]:
    """The cases this test run tries: RELAY_KILL_POINTS's, the whole matrix, or the seeded sample."""
    if ids := os.environ.get("RELAY_KILL_POINTS"):
        return named(ids)
    return ordered(matrix()) if whole else sample(rng_seed)


def ordered(cases: list[Case]) -> list[Case]:
    return sorted(cases, key=lambda c: (c[1], FAULT_PHASES.index(c[0]), c[2]))
