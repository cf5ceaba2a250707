"""Settings drift: a resumed run must stay the experiment it started as.

At the freeze (the first chunk) the run records a snapshot of its resume-critical settings: the
spec's marked keys, what the trainer derives from them (its resolved settings), and the frozen
data's fingerprint. Before each chunk the snapshot of what this chunk would run is compared key by
key. Another rollout.n, adv_estimator, KL setting, batch size, world size or LR schedule fails with
a diff; a deliberate change is made explicit with the `allow_drift` Param and recorded in the run
record with who and when.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from relay.common.errors import RelayError
from relay.common.timestamps import utc_now
from relay.data.freeze import frozen_files
from relay.runs.record import read_record, update_record
from relay.runs.run import Run
from relay.spec.kinds import KINDS


class DriftError(RelayError):
    """The settings of this chunk differ from the run's recorded ones: `table` says how, key by key; `keys`
    are what allow_drift would name to accept them."""

    retry_helps = False

    def __init__(self, what: str, fix: str | None = None, *, table: str = "", keys: Sequence[str] = ()):
        super().__init__(what, fix)
        self.table, self.keys = table, list(keys)


@dataclass
class Change:
    key: str
    was: Any
    now: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.was!r} -> {self.now!r}"


MISSING = "<absent>"


def snapshot(spec, run_dir=None) -> dict[str, Any]:
    """The resume-critical settings this chunk would run with (spec + trainer-derived + frozen data)."""

    files = frozen_files(run_dir) if run_dir is not None else None
    rows = sum(f.rows for f in files if f.role == "train") if files else None
    values = {**spec.resume_critical(), **KINDS[spec.trainer.kind].resolved_settings(spec, rows)}
    if files:
        values["data.fingerprint"] = {f.role + ":" + f.source: f.sha256 for f in files}
    return values


def compare(recorded: dict, current: dict) -> list[Change]:
    keys = sorted(set(recorded) | set(current))
    return [
        Change(k, recorded.get(k, MISSING), current.get(k, MISSING))
        for k in keys
        if recorded.get(k, MISSING) != current.get(k, MISSING)
    ]


def _added_since(spec, change: Change) -> bool:
    """A setting Relay added after the run recorded its settings, at the default that keeps the old behaviour
    (trainer.settings.device: cuda, say): an upgrade of Relay, not a change of the run."""
    if change.was != MISSING or change.now == MISSING:
        return False
    prefix, obj = ("trainer.settings.", spec.settings) if change.key.startswith("trainer.settings.") else ("", spec)
    *parents, leaf = change.key[len(prefix) :].split(".")
    for part in parents:
        obj = getattr(obj, part, None)
    field = getattr(type(obj), "model_fields", {}).get(leaf)
    return field is not None and not field.is_required() and field.get_default(call_default_factory=True) == change.now


def _allowed(key: str, allow: list[str]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in allow)


def world_size_keys(spec) -> tuple[str, ...]:
    """The settings that only say how many processes train (the kind's TrainerSettings.WORLD_SIZE_KEYS; verl:
    nnodes x n_gpus_per_node). With checkpoints.on_world_size_change: reshard, a change of them is accepted
    without allow_drift: the checkpoint is resharded before the chunk's job (relay.checkpoints.reshard), and the
    change is recorded."""
    own = KINDS[spec.trainer.kind].settings_model().WORLD_SIZE_KEYS
    return (*(f"trainer.settings.{k}" for k in own), "resolved.world_size")


RESHARD_POLICY = "checkpoints.on_world_size_change: reshard"


def record(run: Run, *, by: str = "") -> dict:
    """Record the run's settings snapshot: at the freeze, once the data's fingerprint is known."""
    values = snapshot(run.spec, run.dir)
    update_record(run.dir, settings={"values": values, "recorded_at": _now(), "by": by})
    return values


def check(
    run: Run, *, allow_drift: Sequence[str] = (), by: str = "", dag_run: str = "", persist: bool = True
) -> list[Change]:
    """Compare this chunk's settings with the run's recorded ones (nothing to compare before the freeze).

    Changes not covered by allow_drift raise DriftError with a key-by-key diff; allowed changes are
    recorded (who, when, what) and become the run's settings from then on (with persist=True).
    Returns the allowed changes.
    """
    run_dir = run.dir
    rec = read_record(run_dir)
    settings = rec.get("settings")
    if settings is None:
        return []
    current = snapshot(run.spec, run_dir)
    changes = [c for c in compare(settings["values"], current) if not _added_since(run.spec, c)]
    allow = list(allow_drift)
    sizes = world_size_keys(run.spec)
    if run.spec.checkpoints.on_world_size_change == "reshard" and any(c.key in sizes for c in changes):
        allow += [RESHARD_POLICY, *(c.key for c in changes if c.key in sizes)]
    allowed = [c for c in changes if _allowed(c.key, allow)]
    # What the trainer derives (resolved.*) follows an allowed change of the spec; on its own (a new
    # trainer version resolving other defaults, say) it is drift like any other.
    refused = [c for c in changes if c not in allowed and not (c.key.startswith("resolved.") and allowed)]
    if refused:
        table = "\n".join(f"  {c}" for c in refused)
        raise DriftError(
            f"run {run}: {len(refused)} resume-critical setting(s) differ from the run's recorded ones "
            f"(recorded {settings.get('recorded_at')}):\n{table}",
            "restore these settings in the spec; or, if the change is deliberate, trigger with allow_drift: "
            f"{_to_allow(refused)} (it is recorded); or start a new run",
            table=table,
            keys=_to_allow(refused),
        )
    if changes and persist:
        drift = [
            *rec.get("drift", []),
            {
                "at": _now(),
                "by": by,
                "dag_run": dag_run,
                "allowed": [a for a in allow if a not in sizes],
                "changes": [{"key": c.key, "was": c.was, "now": c.now} for c in changes],
            },
        ]
        update_record(run_dir, settings={"values": current, "recorded_at": _now(), "by": by}, drift=drift)
    return changes


def _to_allow(refused: list[Change]) -> list[str]:
    """The keys a person changes: resolved.* follow an allowed spec key, so name them only alone."""
    spec_keys = [c.key for c in refused if not c.key.startswith("resolved.")]
    return spec_keys or [c.key for c in refused]


def _now() -> str:
    return utc_now()
