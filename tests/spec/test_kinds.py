"""The trainer kinds' registry: Relay's own, and a team's through the entry point group relay.trainers."""

from __future__ import annotations

import sys


def test_a_broken_or_clashing_trainer_kind_is_left_out_and_said_when_named(monkeypatch):
    """A team's entry point that fails to import, names no TrainerKind, or takes a name Relay has, leaves Relay
    working: the kind is left out, and naming it in a spec says why."""
    import types
    from importlib.metadata import EntryPoint

    from relay.spec import kinds

    clash = types.ModuleType("team_clash")
    clash.KIND = kinds.TrainerKind("tiny_grpo", "team_clash:Settings", "team_clash:train_chunk", "a clash")
    monkeypatch.setitem(sys.modules, "team_clash", clash)
    eps = [
        EntryPoint("gone_kind", "no_such_module_anywhere.kind:KIND", kinds.ENTRY_POINT_GROUP),
        EntryPoint("not_a_kind", "relay.spec.kinds:BUILT_IN", kinds.ENTRY_POINT_GROUP),
        EntryPoint("tiny_grpo", "team_clash:KIND", kinds.ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(kinds, "entry_points", lambda group: eps if group == kinds.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(kinds, "BROKEN", {})
    found = kinds._registered()
    assert sorted(found) == sorted(kinds.BUILT_IN) and found["tiny_grpo"].name == "tiny_grpo"
    assert "did not load: ModuleNotFoundError" in kinds.unknown_kind("gone_kind")
    assert "is not a relay.spec.kinds.TrainerKind named 'not_a_kind'" in kinds.unknown_kind("not_a_kind")
    assert "names a kind Relay already has" in kinds.BROKEN["tiny_grpo"]
    assert "entry point group 'relay.trainers'" in kinds.unknown_kind("never_registered")
