"""Checkpoint validation, in named levels, producing a structured CheckReport.

No checkpoint is resumed from until it has been proven whole: `structure` (every file the layout
requires, for the world size the shards and fsdp_config.json record) and `loadability` (every .pt
passes its zip CRC and loads through the safe loader).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay import layout, safeload
from relay.errors import CheckpointError


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class CheckReport:
    run_dir: str
    step: int | None
    checks: list[Check] = field(default_factory=list)
    world_size: int | None = None
    fsdp_version: int | None = None

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failed(self) -> Check | None:
        return next((c for c in self.checks if not c.ok), None)

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, ok, detail))
        return ok

    @property
    def path(self) -> str:
        return str(layout.step_dir(Path(self.run_dir), self.step)) if self.step is not None else self.run_dir

    def summary(self) -> str:
        head = f"checkpoint {self.path}: {'VALID' if self.ok else 'INVALID'}"
        return "\n".join([head] + [f"  {'✔' if c.ok else '✘'} {c.name}: {c.detail}" for c in self.checks])

    def to_json(self) -> str:
        return json.dumps(dict(asdict(self), ok=self.ok), indent=2)


def validate_checkpoint(run_dir: Path, step: int | None = None, *, load: bool = True,
                        expected_world_size: int | None = None) -> CheckReport:
    """Validate global_step_<step> of a run (default: the step the tracker names)."""
    run_dir = Path(run_dir)
    report = CheckReport(str(run_dir), step)
    if step is None:
        try:
            step = layout.read_tracker(run_dir)
        except CheckpointError as e:
            report.add("structure", False, e.what)
            return report
        if step is None:
            report.add("structure", False, f"no tracker ({layout.TRACKER}) in {run_dir}")
            return report
        report.step = step
    if not _structure(report, layout.step_dir(run_dir, step), expected_world_size):
        return report
    if load:
        _loadability(report, layout.step_dir(run_dir, step))
    return report


def _structure(report: CheckReport, ckpt: Path, expected_world_size: int | None) -> bool:
    if not ckpt.is_dir():
        return report.add("structure", False, f"{ckpt.name} does not exist")
    if layout.is_rotation_leftover(ckpt):
        return report.add("structure", False, f"{ckpt.name} is a rotation leftover (no actor/), not a checkpoint")
    missing: list[str] = []
    for role in layout.ROLES:
        role_dir = ckpt / role
        if role == "critic" and not role_dir.exists():
            continue  # GRPO has no critic; a critic folder, when present, must be complete
        try:
            cfg = layout.read_fsdp_config(role_dir)
        except CheckpointError as e:
            return report.add("structure", False, e.what)
        if cfg is None:
            missing.append(f"{role}/fsdp_config.json")
            continue
        ws = int(cfg.get("world_size", 0))
        report.world_size, report.fsdp_version = ws, cfg.get("FSDP_version")
        named = {int(m.group(2)) for p in role_dir.iterdir() if (m := layout.SHARD.match(p.name))}
        if named - {ws}:
            return report.add("structure", False,
                              f"{role}/ shards name world size {sorted(named)}, fsdp_config.json records {ws}")
        for rank in range(ws):
            for kind in layout.SHARD_KINDS:
                f = role_dir / layout.shard_name(kind, ws, rank)
                if not f.is_file() or f.stat().st_size == 0:
                    missing.append(f"{role}/{f.name}" + (" (empty)" if f.is_file() else ""))
        hf = role_dir / "huggingface" / "config.json"
        if not hf.is_file() or hf.stat().st_size == 0:
            missing.append(f"{role}/huggingface/config.json")
    data = ckpt / "data.pt"
    if not data.is_file() or data.stat().st_size == 0:
        missing.append("data.pt" + (" (empty)" if data.is_file() else ""))
    if missing:
        return report.add("structure", False, f"{ckpt.name} is missing: {', '.join(missing)}")
    if expected_world_size is not None and report.world_size != expected_world_size:
        return report.add("structure", False,
                          f"world size {report.world_size}, but the run trains at world size {expected_world_size}")
    return report.add("structure", True,
                      f"complete for world size {report.world_size} (FSDP{report.fsdp_version})")


def _loadability(report: CheckReport, ckpt: Path) -> bool:
    files = sorted(ckpt.rglob("*.pt"))
    for f in files:
        try:
            safeload.load(f)
        except CheckpointError as e:
            return report.add("loadability", False, e.what)
    return report.add("loadability", True, f"{len(files)} .pt files pass their CRC and load with weights_only")


def latest_valid_step(run_dir: Path, *, load: bool = False) -> int | None:
    """The step the tracker names if that checkpoint is structurally whole; None for a fresh run.

    Raises CheckpointError when the run has checkpoints but the tracker's is missing or broken:
    a resume must never silently start again at step 0.
    """
    run_dir = Path(run_dir)
    step = layout.read_tracker(run_dir)
    if step is None:
        real = [s for s, p in layout.step_dirs(run_dir).items() if not layout.is_rotation_leftover(p)]
        if real:
            raise CheckpointError(
                f"{run_dir} holds checkpoints (steps {real}) but no tracker ({layout.TRACKER})",
                f"run `python -m relay checkpoint validate {run_dir} --step {max(real)}`, and if it is valid "
                f"write {max(real)} into {layout.TRACKER}",
            )
        return None
    report = validate_checkpoint(run_dir, step, load=load)
    if not report.ok:
        raise CheckpointError(
            f"the tracker of {run_dir} names step {step}, which is not a valid checkpoint: {report.failed.detail}",
            f"run `python -m relay checkpoint validate {run_dir}` and point the tracker at the newest valid step",
        )
    return step
