"""The pre-resume checklist as one command (`python -m relay doctor SPEC [--run NAME]`).

Field guides for verl ask for these checks by hand before every resume. Each is answered here by
the code the DAG itself runs: the resume validation and quarantine records (resume, validate), the
live-job query the chunk operator makes before it submits (ray_jobs), the run's lease, the settings
guard of preflight.settings (guard) and the source check of preflight.data (data.freeze). For a
trainer kind with an environment check it says what that check finds (verl_ppo: whether its attention
implementation can be loaded, as far as that can be known from here): a warning (⚠), which never makes a
resume unsafe; and for a kind with a library contract, whether the cluster's library still has every touch
point Relay relies on (verl_ppo: relay.trainers.verl_ppo.verl_contract, run as a Ray job there; this host's verl
with --offline). When the run's last attempt failed and no checkpoint was saved since, it names that failure's
cause as the train task classified it (relay.runs.failure_cause), with what to do: a warning too. The DAG's
preflight.run task logs this same checklist, so the UI and the terminal never disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from relay.checkpoints import swap
from relay.checkpoints.resume import quarantined
from relay.checkpoints.validate import validate_checkpoint
from relay.common.errors import RelayError
from relay.data import freeze as frozen
from relay.insights import save_interval as interval
from relay.preflight import guard
from relay.runs import failure_cause, layout
from relay.runs.metrics import read_events
from relay.runs.prompt_ledger import PromptLedger
from relay.runs.record import read_record
from relay.runs.run import Run
from relay.spec.kinds import KINDS

# Snapshot keys (guard.snapshot) by what they mean; spec keys are under trainer.settings.
ALGORITHM = {
    "adv_estimator",
    "rollout_n",
    "use_kl_loss",
    "kl_loss_coef",
    "kl_loss_type",
    "clip_ratio",
    "temperature",
    "train_batch_size",
    "ppo_mini_batch_size",
    "max_response_length",
    "resolved.rollouts_per_step",
    "resolved.lr_schedule",
    "resolved.lr_horizon",
}


def _topic(key: str) -> str:
    name = key.removeprefix("trainer.settings.")
    if name.startswith("model."):
        return "model"
    if name in ALGORITHM or name.startswith("optim."):
        return "algorithm"
    if name.removeprefix("resolved.") in ("world_size", "fsdp_version"):
        return "parallelism"
    return "other"


@dataclass
class Finding:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warning: bool = False  # ok for a resume, but worth acting on (its fix is shown)

    def line(self) -> str:
        mark = "✘" if not self.ok else "⚠" if self.warning else "✔"
        return f"{mark} {self.name}: {self.detail}" + (f"\n    fix: {self.fix}" if mark != "✔" and self.fix else "")

    def to_dict(self) -> dict:
        return asdict(self)


def _changes(run: Run, topic: str | None = None) -> list[guard.Change]:
    """The settings this chunk would run with, against the run's recorded snapshot (nothing written)."""
    recorded = (read_record(run.dir).get("settings") or {}).get("values")
    if recorded is None:
        return []
    changes = guard.compare(recorded, guard.snapshot(run.spec, run.dir))
    return [c for c in changes if topic is None or _topic(c.key) == topic]


def interrupted_swap(run: Run) -> Finding | None:
    """A reshard killed while it swapped a step folder: finished or undone here, before anything looks at it."""
    done = swap.recover(run.dir) if run.dir.is_dir() else None
    return (
        Finding(
            "interrupted reshard",
            True,
            done,
            "nothing: the step folder is whole again; run `relay checkpoint "
            f"reshard {run.dir} ...` again if its reshard was undone",
            warning=True,
        )
        if done
        else None
    )


def checkpoint(run: Run, store=None, *, deep: bool = True) -> Finding:
    """The newest valid checkpoint, local and published, and what was quarantined after it."""
    run_dir = run.dir
    name = "checkpoint"
    published = None
    if store is not None:
        try:
            published = (store.latest(run.name) or {}).get("step")
        except RelayError as e:
            return Finding(name, False, f"S3 unreachable: {e.what}", e.fix or "")
    in_s3 = f"; published latest: {published if published is not None else 'none'}" if store is not None else ""
    try:
        tracker = layout.read_tracker(run_dir)
    except RelayError as e:
        return Finding(
            name,
            False,
            e.what,
            f"run `python -m relay checkpoint validate {run_dir}` and point the "
            "tracker at the newest valid step (the next chunk does this itself)",
        )
    if tracker is None:
        steps = sorted(layout.step_dirs(run_dir)) if run_dir.is_dir() else []
        if steps:
            return Finding(
                name,
                False,
                f"checkpoints {steps} but no tracker",
                f"validate step {steps[-1]} (`python -m relay checkpoint validate {run_dir} --step "
                f"{steps[-1]} --quarantine`); it writes the tracker when valid",
            )
        return Finding(name, True, f"no checkpoint yet: a resume starts at step 0{in_s3}")
    report = validate_checkpoint(run_dir, tracker, upto="numerics" if deep else "consistency")
    if not report.ok:
        bad = report.failed
        assert bad is not None  # the report is not ok: one of its checks failed
        return Finding(
            name,
            False,
            f"latest step {tracker} is INVALID: {bad.name}: {bad.detail}",
            "the next chunk quarantines it and falls back to the newest valid step; to see why, run "
            f"`python -m relay checkpoint validate {run_dir} --step {tracker}`",
        )
    later = [q for q in quarantined(run_dir) if (q.get("step") or 0) > tracker]
    if later:
        q = later[-1]
        failed: dict[str, Any] = next((c for c in q.get("checks", []) if not c.get("ok")), {})
        return Finding(
            name,
            False,
            f"step {q['step']} was quarantined ({failed.get('name')}: {failed.get('detail')}) to "
            f"{q['quarantine_path']}; a resume falls back to step {tracker} and trains "
            f"{q['step'] - tracker} steps again{in_s3}",
            f"read {q['quarantine_path']}.report.json; restore step {q['step']} from S3 if it was "
            f"published (`python -m relay checkpoint restore URI {run_dir} --step {q['step']}`), or "
            "accept the fallback by resuming",
        )
    how = "every level" if deep else "structure"
    return Finding(name, True, f"newest valid step {tracker} ({how}){in_s3}; nothing quarantined after it")


def live(run: Run, jobs=None) -> Finding:
    """No live Ray job of the run, and no live trainer holding its lease on this host."""
    name = "no live attempt"
    alive = []
    if jobs is not None:
        try:
            alive = [f"Ray job {j.submission_id} ({j.status})" for j in jobs.live_jobs_of_run(run.spec.name, run.name)]
        except RelayError as e:
            return Finding(
                name,
                False,
                e.what,
                "start the Ray head or give its dashboard address (--ray-address, RAY_ADDRESS, or the DAG's Ray connection)",
            )
        except Exception as e:  # noqa: BLE001 - any other failure to reach the Jobs API
            return Finding(
                name,
                False,
                f"cannot ask Ray at {jobs.address} for live jobs: {e}",
                "start the Ray head or give its dashboard address (--ray-address, RAY_ADDRESS)",
            )
    lease = run.folder.lease()
    held = lease.current() if run.dir.is_dir() else None
    holder = ""
    if held:
        holder = (
            f"lease token {held.get('token')} last taken by {held.get('holder') or 'nobody'} (pid "
            f"{held.get('pid')} on {held.get('host')})"
        )
        writer = lease.writer()
        if writer is not None and writer[0]:
            alive.append(f"trainer {writer[1]} still runs")
    if alive:
        return Finding(
            name,
            False,
            "; ".join(alive) + (f"; {holder}" if holder else ""),
            "stop it before resuming (`ray job stop ID`, or kill the pid); a chunk started by the DAG "
            "stops the run's live jobs itself, and the lease fences out a stale trainer's saves",
        )
    return Finding(name, True, "no live job or trainer of this run" + (f"; {holder}" if holder else ""))


def model(run: Run) -> Finding:
    changed = _changes(run, "model")
    if changed:
        return Finding(
            "model",
            False,
            "; ".join(map(str, changed)),
            "restore the model settings in the spec, or start a new run from this checkpoint's weights",
        )
    return Finding("model", True, "unchanged since the freeze" if _recorded(run) else "nothing recorded yet")


def parallelism(run: Run) -> Finding:
    """The spec's world size and FSDP version against the latest checkpoint's shard names."""
    core, kind = run.spec.core_settings, KINDS[run.spec.trainer.kind]
    want = (core.world_size, core.fsdp_version)
    run_dir = run.dir
    try:
        step = layout.read_tracker(run_dir)
    except RelayError:
        step = None
    if step is None:
        return Finding("parallelism", True, f"world size {want[0]}, FSDP{want[1]}; no checkpoint to compare with")
    report = validate_checkpoint(run_dir, step, upto="structure")
    have = (report.world_size, report.fsdp_version)
    allowed = [o.world_size for o in core.world_options]
    if allowed and have[0] in allowed and have[1] == want[1]:  # elastic: any allowed size; the next chunk picks one
        return Finding(
            "parallelism",
            True,
            f"step {step}'s shards are world size {have[0]}, FSDP{have[1]}: one of the spec's elastic world sizes "
            f"({', '.join(map(str, allowed))}); each chunk's cold start reshards it to the size the cluster holds",
        )
    if want != have and report.world_size is not None:
        shard = layout.shard_name("model", report.world_size, 0)
        command = f"python -m relay checkpoint reshard {run_dir} --world-size {want[0]}"
        if kind.reshard and want[1] == have[1] and isinstance(want[0], int) and want[0] >= 1:
            # Only the number of GPUs changed: Relay reshards verl's FSDP checkpoints (relay.checkpoints.reshard).
            if run.spec.checkpoints.on_world_size_change == "reshard":
                return Finding(
                    "parallelism",
                    True,
                    f"the spec asks for world size {want[0]}; step {step}'s shards are world size {have[0]}: "
                    "the DAG's next chunk or `relay train` reshards it first (checkpoints.on_world_size_change: reshard)",
                    f"or reshard it now: `{command}`",
                    warning=True,
                )
            fix = (
                f"reshard step {step} to the spec's world size: `{command}` (the original is kept in "
                ".relay/resharded/), or set checkpoints.on_world_size_change: reshard and the DAG's next chunk or "
                f"`relay train` does it, or set nnodes x n_gpus_per_node back to {have[0]}"
            )
        else:
            fix = f"set trainer.settings.world_size: {have[0]} and fsdp_version: {have[1]} again; " + (
                "its checkpoints load only at the FSDP version they were written with"
                if kind.reshard
                else f"a {kind.name} checkpoint is not resharded (its trainer kind cannot: `relay checkpoint reshard` "
                "is for the kinds that can)"
            )
        return Finding(
            "parallelism",
            False,
            f"the spec asks for world size {want[0]}, FSDP{want[1]}; step {step}'s shards are world size "
            f"{have[0]}, FSDP{have[1]} ({shard})",
            fix,
        )
    return Finding("parallelism", True, f"world size {have[0]}, FSDP{have[1]}, as step {step}'s shards")


def algorithm(run: Run) -> Finding:
    changed = _changes(run, "algorithm")
    if changed:
        return Finding(
            "algorithm",
            False,
            "; ".join(map(str, changed)),
            f"restore them in the spec, or trigger with allow_drift: {[c.key for c in changed]} if the "
            "change is deliberate (recorded)",
        )
    s = run.spec.settings
    parts = [f"{k}={getattr(s, k)}" for k in ("adv_estimator", "rollout_n", "use_kl_loss", "kl_loss_coef") if hasattr(s, k)]
    return Finding("algorithm", True, ", ".join(parts) + (" as recorded" if _recorded(run) else ""))


def data(run: Run) -> Finding:
    """The frozen copies against their sha256, and each source against the frozen fingerprint."""
    run_dir = run.dir
    files = frozen.frozen_files(run_dir)
    if files is None:
        return Finding("data", True, "not frozen yet: the first chunk freezes it")
    try:
        frozen.verify_frozen(run_dir, [f for f in files if f.path(run_dir).is_file() or not f.uri])
    except RelayError as e:
        return Finding("data", False, e.what, e.fix or "")
    changes = frozen.source_changes(run_dir, files)
    shas = ", ".join(f"{f.role} {f.sha256[:12]} ({f.rows} rows)" for f in files)
    if changes and run.spec.data.on_source_change == "fail":
        return Finding(
            "data",
            False,
            " ".join(c.summary() for c in changes).replace("\n", "; "),
            "restore the source files, or set data.on_source_change: use_frozen to go on with the frozen "
            "copy (a new dataset is a new run)",
        )
    if changes:
        return Finding(
            "data",
            True,
            f"frozen copies intact ({shas}); sources changed, training goes on with the frozen copies (use_frozen)",
        )
    return Finding("data", True, f"frozen copies and sources match ({shas})")


def prompts_in_flight(run: Run) -> Finding | None:
    """verl's async trainer: the prompts in flight at the newest checkpoint, and verl's queue that holds them
    (relay.runs.prompt_ledger); a resume without it would be refused (quarantined, the tracker moved back)."""
    if not run.spec.core_settings.prompts_in_flight:
        return None
    step = layout.read_tracker(run.dir)
    if not step:
        return Finding("prompts", True, "no checkpoint yet: the first step hands out the warm-up batches")
    folder = layout.step_dir(run.dir, step)
    try:
        ledger = PromptLedger.read(folder)
    except RelayError as e:
        return Finding("prompts", False, e.what, e.fix or "")
    rows = sorted(p.index for p in ledger.live.values())
    held = f"{len(rows)} prompt(s) in flight at step {step} (dataset rows {rows[:8]}{' ...' if len(rows) > 8 else ''})"
    if rows and not (folder / "transfer_queue").is_dir():
        return Finding(
            "prompts",
            False,
            f"{held}, but verl's transfer_queue/ that holds them is gone: the resume would skip them and is refused",
            f"restore step {step} from S3 (`relay checkpoint restore`), or let the resume fall back to an earlier step",
        )
    return Finding("prompts", True, f"{held}, held in verl's transfer_queue/; {ledger.next_seq} handed out so far")


def settings(run: Run) -> Finding:
    """Every resume-critical setting, as preflight.settings checks them (no allow_drift here)."""
    spec = run.spec
    if not _recorded(run):
        return Finding(
            "settings", True, f"fingerprint {spec.settings_fingerprint()}; nothing recorded yet (recorded at the freeze)"
        )
    try:
        guard.check(run, persist=False)
    except guard.DriftError as e:
        head, *rows = e.what.splitlines()
        return Finding("settings", False, f"{head} {'; '.join(r.strip() for r in rows)}", e.fix or "")
    return Finding(
        "settings",
        True,
        f"fingerprint {spec.settings_fingerprint()}; every resume-critical setting matches the run's recorded ones",
    )


def attention(run: Run) -> Finding | None:
    """The spec against what this host and the cluster image provide: its kind's environment check (verl_ppo:
    whether its attention implementation loads)."""
    result = KINDS[run.spec.trainer.kind].check_environment(run.spec)
    if result is None:
        return None
    return Finding("attention", True, result.detail, result.fix, warning=not result.ok)


def library_contract(run: Run, report: Callable[[bool], tuple[str, dict[str, Any]]] | None = None) -> Finding | None:
    """The trainer kind's contract with the library it trains with (verl_ppo: every touch point of verl Relay relies
    on, relay.trainers.verl_ppo.verl_contract), in the library the chunks will run: `report(cpu)` runs the checks and
    says where (the CLI's: a Ray job on the cluster, or this host's library with --offline). None for a kind without
    one, or without a report (the DAG's cheap checklist: every chunk's driver checks it anyway)."""
    module = KINDS[run.spec.trainer.kind].library_contract_module()
    if module is None or report is None:
        return None
    library = module.LIBRARY
    name = f"{library} contract"
    try:
        where, found = report(run.spec.core_settings.cpu_platform)
    except ImportError as e:
        return Finding(
            name,
            True,
            f"{library} is not installed here ({e})",
            "run without --offline to check the cluster's",
            warning=True,
        )
    except RelayError as e:
        return Finding(name, False, e.what, e.fix or "")
    have, fix = f"{where} {library} {found['version']}", found["fix"]
    if found["problems"]:
        return Finding(name, False, f"{have}: " + " | ".join(found["problems"]), fix)
    if found["loop_bound"]:
        detail = (
            f"{have}: " + " | ".join(found["loop_bound"]) + ": chunks end through "
            "total_training_steps, and a horizon-dependent LR schedule is refused in chunks"
        )
        return Finding(name, True, detail, fix, warning=True)
    return Finding(name, True, f"{have} (torch {found['torch']}): all {found['checked']} touch points hold")


def last_failure(run: Run) -> Finding | None:
    """The cause of the run's last failed attempt (relay.runs.failure_cause, as the train task classified it),
    when no checkpoint was saved since: a warning that says what to do before trying again."""
    events = read_events(run.dir) if run.dir.is_dir() else []
    last = next(
        (i for i in range(len(events) - 1, -1, -1) if events[i].get("event") in (failure_cause.EVENT, "checkpoint")), None
    )
    if last is None or events[last]["event"] != failure_cause.EVENT:
        return None
    e = events[last]
    cause = failure_cause.Cause(
        e.get("cause", failure_cause.UNKNOWN), e.get("step"), e.get("evidence") or [], e.get("signature")
    )
    policy = e.get("policy") or failure_cause.policy(cause, run.spec.airflow.retry_on)
    detail = f"attempt {e.get('attempt')} of chunk {e.get('chunk')}: {cause.describe()}; policy {policy}"
    if cause.evidence:
        detail += f"; evidence: {' | '.join(cause.evidence)}"
    return Finding("last failure", True, detail, cause.todo, warning=True)


def save_interval(run: Run) -> Finding | None:
    """The save interval the run's own costs and failures call for (Young–Daly, relay.insights.save_interval): a
    warning when the spec's is off by more than half or twice; nothing before a step and a save were measured."""
    spec = run.spec
    found = (
        interval.save_interval(
            run.dir,
            chunk_steps=spec.chunk_steps,
            save_freq=spec.core_settings.save_freq,
            mtbf_hours=spec.checkpoints.mtbf_hours,
            total_steps=spec.total_steps,
        )
        if run.dir.is_dir()
        else None
    )
    if found is None:
        return None
    best = found.young_daly_steps
    off = best is not None and not 0.5 <= found.interval_steps / best <= 2
    return Finding(
        "save interval", True, found.advice(), "change it as said above (nothing changes automatically)", warning=off
    )


def _recorded(run: Run) -> bool:
    return bool(read_record(run.dir).get("settings"))


def diagnose(run: Run, *, store=None, jobs=None, deep: bool = True, contract_report=None) -> list[Finding]:
    """The whole checklist, cheap checks first where it matters little. contract_report: the trainer kind's library
    contract checks (see library_contract; the CLI, above this layer, runs them)."""
    findings = [
        interrupted_swap(run),
        checkpoint(run, store, deep=deep),
        live(run, jobs),
        model(run),
        parallelism(run),
        algorithm(run),
        data(run),
        settings(run),
        prompts_in_flight(run),
        attention(run),
        library_contract(run, contract_report) if deep else None,
        last_failure(run),
        save_interval(run),
    ]
    return [f for f in findings if f is not None]


def report(findings: list[Finding], run: Run) -> str:
    ok = all(f.ok for f in findings)
    head = f"relay doctor: run {run} of spec {run.spec.name} ({run.dir})"
    tail = "a resume is safe" if ok else f"a resume is NOT safe: {sum(not f.ok for f in findings)} check(s) failed"
    warned = sum(f.ok and f.warning for f in findings)
    tail += f" ({warned} warning(s) above)" if warned else ""
    return "\n".join([head] + [f.line() for f in findings] + [tail])
