"""Pre-resume hygiene for verl's main_ppo, as field guides ask for it by hand before every resume.

1. In the sync mode, rollout-engine state left in a checkpoint folder (verl's async modes write
   `transfer_queue/`: in-flight rollout prompts; an async run resumes from it) is moved out before anything reads
   the folder: a sync trainer never loads it, it is not model state, and it is not Relay's to publish. It is kept under
   .relay/rollout_state/, not deleted. A manifest that listed it is set aside with it, so the
   checkpoint is validated afresh, every level, by the resume that follows.
2. The tracker and the folders agree: Relay's resume (the checkpoint validator: quarantine,
   fallback) has chosen step N; verl's own lookup (find_latest_ckpt_path over the same folder)
   must name global_step_N too, or the chunk stops before verl starts.
3. The world size (nnodes x n_gpus_per_node) and the FSDP version of the spec are those of the
   checkpoint's shards: verl's FSDP checkpoints do not reshard on load.
"""

from __future__ import annotations

from pathlib import Path

from relay.checkpoints import manifest
from relay.common.errors import CheckpointError, SpecError
from relay.common.timestamps import utc_stamp
from relay.runs import layout
from relay.runs.metrics import record_event
from relay.trainers.verl_ppo.verl_chunk import ROLLOUT_STATE

ASIDE = "rollout_state"


def remove_rollout_state(run_dir: Path) -> list[str]:
    """Move rollout-engine state out of every step folder of a run. Returns what was moved (relative)."""
    run_dir = Path(run_dir)
    moved = []
    stamp = utc_stamp()
    for step, folder in layout.step_dirs(run_dir).items():
        found = [n for n in ROLLOUT_STATE if (folder / n).exists()]
        if not found:
            continue
        dest = layout.relay_dir(run_dir, ASIDE, f"{folder.name}.{stamp}")
        dest.mkdir(parents=True, exist_ok=True)
        for name in found:
            (folder / name).rename(dest / name)
            moved.append(f"{folder.name}/{name}")
        m = folder / manifest.NAME
        if m.exists():
            try:
                listed = manifest.read(folder)
            except CheckpointError:
                listed = None
            if listed is None or any(rel.split("/", 1)[0] in found for rel in listed.files):
                m.rename(dest / manifest.NAME)
                moved.append(f"{folder.name}/{manifest.NAME}")
        record_event(run_dir, "rollout_state_removed", step=step, moved=found, to=str(dest))
    return moved


def check_tracker_agrees(run_dir: Path, resume_step: int) -> None:
    """verl's own resume lookup names the checkpoint Relay validated (or nothing, for a fresh start)."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    found = find_latest_ckpt_path(str(run_dir))
    want = str(layout.step_dir(Path(run_dir), resume_step)) if resume_step else None
    if (found and str(Path(found))) != want:
        raise CheckpointError(
            f"verl would resume from {found or 'scratch (step 0)'}, but Relay validated "
            f"{want or 'no checkpoint (step 0)'} in {run_dir}: the tracker and the folders disagree",
            f"run `python -m relay checkpoint validate {run_dir}` and retry the chunk",
        )


def check_parallelism(spec, run_dir: Path, resume_step: int, report=None, settings=None) -> None:
    """Refuse a world-size or FSDP-version change against the checkpoint the chunk resumes from. settings: the
    job's (an elastic spec's at the world size chosen for it); default the spec's."""
    if not resume_step:
        return
    s = settings or spec.settings
    if report is not None and report.world_size is not None:
        found = (report.world_size, report.fsdp_version)
    else:
        cfg = layout.read_fsdp_config(layout.step_dir(Path(run_dir), resume_step) / "actor") or {}
        found = (cfg.get("world_size"), cfg.get("FSDP_version"))
    want = (s.world_size, s.fsdp_version)
    have = tuple(int(x) if x is not None else None for x in found)
    if have[0] is not None and have != want:
        shard = layout.shard_name("model", have[0], 0)
        if spec.checkpoints.on_world_size_change == "reshard" and have[1] == want[1]:
            # The step was reached after the chunk's reshard ran (a resume refused and fallen back to an older step).
            fix = (
                f"reshard step {resume_step} first: `relay checkpoint reshard {run_dir} --world-size {want[0]} "
                f"--step {resume_step}`, or clear the chunk's reshard task with its downstream tasks (`relay train` "
                "reshards by itself)"
            )
        else:
            fix = (
                f"set nnodes x n_gpus_per_node = {have[0]} and fsdp_version: {have[1]} again: verl's FSDP checkpoints "
                "do not reshard on load (a different world size is a new run)"
            )
        raise SpecError(
            spec.source,
            "trainer.settings",
            f"the spec asks for world size {want[0]} (nnodes {s.nnodes} x n_gpus_per_node {s.n_gpus_per_node}), "
            f"FSDP{want[1]}; step {resume_step}'s shards are world size {have[0]}, FSDP{have[1]} ({shard})",
            fix,
        )
