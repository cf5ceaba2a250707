"""Training runs: which run a trigger continues or starts, the guarded fresh start, and its incarnation.

A training run is a folder <checkpoint_dir>/<run name> (verl's default_local_dir) and, with a store,
its S3 prefix <prefix>/<run name>/. Triggering a spec's DAG (or `relay train`) with the name of an
existing run continues it from its latest valid checkpoint. A fresh start must be confirmed by typing
the run's name; it moves the old run aside, locally (<checkpoint_dir>/.archive/) and in S3
(<prefix>/.archive/), never deleting it, and begins a new incarnation (relay.runs.record), so that nothing
of the old life can be restored into the new one.

A fresh start never moves a run aside under a live writer: a trainer of the run that still runs on this
host, or a live Ray job of the run, refuses it, named. A writer this host cannot see (a trainer on another
node) is named in the log, and its lease token, bound to the old incarnation and below every token of the
new one (relay.runs.lease), keeps it from writing into the new run. A fresh start happens once per DAG run:
the run record keeps which one performed it, and that DAG run cleared and run again continues the run.

A folder with no run record whose name S3 holds is refused: continuing the published run is a
deliberate `relay checkpoint restore`, which brings its record along.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relay.checkpoints.validate import latest_step_or_problem
from relay.common.errors import RunError
from relay.common.faultpoint import fault_point
from relay.common.files import atomic_write_json
from relay.common.timestamps import utc_now, utc_stamp
from relay.runs import layout
from relay.runs.lease import FRESH_START_PENDING, Lease
from relay.runs.record import (
    VERSION,
    folder_incarnation,
    incarnation_of,
    new_incarnation,
    read_record,
    update_record,
    write_record,
)
from relay.runs.run import Run
from relay.spec.plan import ChunkPlan
from relay.spec.run_spec import RunSpec, check_run_name


@dataclass
class RunState:
    run_name: str
    run_dir: str
    latest_step: int  # 0 for a run with no checkpoint yet
    total_steps: int
    next_chunk: int | None  # None when every chunk is done
    archived_to: str | None = None
    problem: str | None = None  # a broken latest checkpoint, which the next chunk's trainer falls back from
    incarnation: str | None = None
    archived_uri: str | None = None  # where a fresh start moved the old incarnation's S3 objects
    notes: list[str] = field(default_factory=list)  # what the caller should tell a person (a warning each)

    def to_dict(self) -> dict:
        return asdict(self)

    def run(self, spec: RunSpec) -> Run:
        """The run this state is of, as the value every later step receives."""
        return Run.of(spec, self.run_name, self.incarnation)


def resolve_run_name(spec: RunSpec, requested: str | None) -> str:
    return check_run_name(requested.strip() if requested and requested.strip() else spec.name)


@dataclass
class FreshStartPlan:
    """What a fresh start of a run would move aside (never delete): its folder and its published prefix."""

    run: str
    local_dir: str | None  # the run's folder, when it holds anything
    local_steps: list[int]
    published_uri: str | None  # <prefix>/<run>/, when S3 holds the run
    published_steps: list[int]

    @property
    def needed(self) -> bool:
        """Whether a fresh start would move anything (a run with nothing is simply started)."""
        return bool(self.local_dir or self.published_uri)

    def where(self) -> str:
        return " and ".join(
            w
            for w in (
                f"checkpoints in {self.local_dir}" if self.local_dir else "",
                f"published checkpoints under {self.published_uri}" if self.published_uri else "",
            )
            if w
        )

    def markdown(self, checkpoint_dir: str, prefix: str | None) -> str:
        """The facts a person approves (the Required Actions page renders Markdown)."""
        lines = [
            f"Run **{self.run}** would start again from step 0, as a new incarnation. The old run is moved "
            "aside, never deleted:",
            "",
        ]
        if self.local_dir:
            lines.append(
                f"- local: `{self.local_dir}` (steps {_steps(self.local_steps)}) to "
                f"`{checkpoint_dir}/.archive/{self.run}-<time>-<random>/`"
            )
        if self.published_uri:
            lines.append(
                f"- S3: `{self.published_uri}` (published steps {_steps(self.published_steps)}) to "
                f"`{prefix}/.archive/{self.run}-<time>-<random>/`"
            )
        lines += ["", "Reject to keep training the run from its latest checkpoint: trigger again without fresh_start."]
        return "\n".join(lines)


def fresh_start_plan(run: Run, store=None) -> FreshStartPlan:
    """What a fresh start of `run` would archive; S3 is looked at only with a store."""
    run_dir = run.dir
    has_local = run_dir.is_dir() and any(run_dir.iterdir())
    published = store.incarnation(run.name) if store is not None else None
    return FreshStartPlan(
        run.name,
        str(run_dir) if has_local else None,
        sorted(layout.step_dirs(run_dir)) if has_local else [],
        f"{store.uri}/{run.name}/" if published else None,
        [m.step for m in store.published(run.name)] if published else [],
    )


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if steps else "none"


def prepare_run(
    spec: RunSpec,
    requested: str | None = None,
    *,
    fresh_start: bool = False,
    confirm: str = "",
    started_by: str = "",
    store=None,
    jobs=None,
    asked_by: str | None = None,
) -> RunState:
    """Resolve the run, apply a (confirmed) fresh start, and write the run record of a new run or incarnation.

    With a store (the spec's S3), the run's published incarnation is checked too: a fresh start moves it
    aside, and a folder that holds another incarnation of the run, or none, is refused. Without one
    (no s3 section, or the CLI's --offline), S3 is never looked at. `jobs` (relay.jobs.ray_jobs.RayJobs) lets a
    fresh start see the run's live Ray jobs too. `asked_by`: who asks for the fresh start (a DAG run's id); a
    fresh start it already performed is not performed again.
    """
    run = Run.of(spec, resolve_run_name(spec, requested))
    name, run_dir = run.name, run.dir
    record = read_record(run_dir) if run_dir.is_dir() else {}
    local = incarnation_of(record)
    notes: list[str] = []
    pending = record.get(PENDING) if isinstance(record.get(PENDING), dict) else None
    if pending is not None:  # a fresh start decided and not finished (its process died): the decision stands
        notes.append(
            f"finishing the fresh start of run {name} that {pending.get('asked_by')} decided at {pending.get('at')}: "
            "it was interrupted before the old run was moved aside"
        )
        fresh_start, asked_by = True, pending.get("asked_by") or asked_by
    elif fresh_start and asked_by and (done := fresh_start_done(run_dir, asked_by)):
        notes.append(
            f"{asked_by} already started run {name} again from step 0 (at {done.get('at')}); it is not started "
            f"again: the run (incarnation {local}) continues from its latest checkpoint"
        )
        fresh_start = False
    has_local = run_dir.is_dir() and any(run_dir.iterdir())
    published = store.incarnation(name) if store is not None else None
    archived = archived_uri = None
    last_token = None
    lineage = _lineage(record)
    if fresh_start and (has_local or published or pending):
        if pending is None and (confirm or "").strip() != name:
            raise RunError(
                f"fresh start of run {name!r} refused: it already has {fresh_start_plan(run, store).where()}",
                f"to start it again from step 0, also set confirm_fresh_start (the CLI: --confirm) to {name!r}; the "
                "old run is moved aside, never deleted. To keep it, trigger without fresh_start, or pick a new run "
                "name",
            )
        # Every refusal comes before anything moves, anywhere; then the decision fences out every older writer.
        notes += refuse_live_writers(run, jobs)
        who = asked_by or started_by
        resumed = pending is not None
        if pending is None:
            pending = decide_fresh_start(run, who) if has_local else _decision(who, None)
        # The lock is not held across S3: the decision's token keeps writers out meanwhile. A resumed decision moves
        # whatever its first try left under the run's prefix (latest.json goes first, so `published` is no guide).
        if store is not None and (published or resumed):
            archived_uri = store.archive_run(name, f"{name}-{pending['archive']}")
        fault_point("fresh_start_archived", 0)
        if has_local:
            archived, last_token = _move_aside(run, pending)
        lineage.append(
            {
                "asked_by": who,
                "at": pending["at"],
                "archived_to": str(archived) if archived else None,
                "archived_uri": archived_uri,
            }
        )
        local = None
    elif published and local != published:
        raise RunError(
            _incarnations_differ(name, run_dir, local, published, store),
            f"to continue the published run here, restore it on purpose: `relay checkpoint restore "
            f"{store.uri} {run_dir}` (it brings the run record along), then trigger again; to "
            f"start it again from step 0, trigger with fresh_start and confirm {name!r} (the published "
            f"run is moved aside, not deleted); or pick another run name",
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    if local is None:
        incarnation = new_incarnation()
        write_record(
            run_dir,
            {
                "version": VERSION,
                "run": name,
                "incarnation": incarnation,
                "spec": spec.name,
                "spec_source": spec.source,
                "created": utc_now(),
                "started_by": started_by,
                "settings_fingerprint": spec.settings_fingerprint(),
                "resume_critical": spec.resume_critical(),
                **(
                    {"previous": {"archived_to": str(archived) if archived else None, "archived_uri": archived_uri}}
                    if archived or archived_uri
                    else {}
                ),
                **({FRESH_STARTS: lineage} if lineage else {}),
            },
        )
        if last_token:
            Lease(run_dir).carry_forward(last_token, incarnation)
    state = run_state(run, archived, archived_uri)
    state.notes = notes
    return state


# The run record's list of every fresh start of the run's name, oldest first (who asked, when, what it moved):
# carried into each new incarnation, so that a DAG run cleared after a newer fresh start never repeats its own.
FRESH_STARTS = "fresh_starts"
FRESH_START = "fresh_start"  # the one fresh start that began an incarnation, in records written before the list
PENDING = FRESH_START_PENDING  # a decided fresh start not finished yet: the next prepare finishes it


def fresh_start_done(run_dir: Path, asked_by: str) -> dict | None:
    """The fresh start `asked_by` (a DAG run's id) performed, in any incarnation of the run up to the folder's."""
    record = read_record(run_dir) if run_dir.is_dir() else {}
    return next((done for done in _lineage(record) if done.get("asked_by") == asked_by), None)


def _lineage(record: dict) -> list[dict]:
    starts = record.get(FRESH_STARTS)
    if isinstance(starts, list):
        return [s for s in starts if isinstance(s, dict)]
    single = record.get(FRESH_START)
    return [single] if isinstance(single, dict) else []


def _decision(who: str, token: int | None) -> dict:
    # Archive names carry randomness beside the time: two fresh starts within a second never meet, here or in S3.
    return {"asked_by": who, "at": utc_now(), "archive": f"{utc_stamp()}-{secrets.token_hex(3)}", "token": token}


def decide_fresh_start(run: Run, who: str) -> dict:
    """Under the run's lock: refuse a live writer, then take the next lease token for the fresh start and record
    the decision in the run record. From then on every older writer is fenced out (its token is no longer the
    lease's) and no submission takes the lease (Lease.acquire refuses while a fresh start is pending), so the S3
    archive can run without the lock; a crash before the local move leaves the decision for the next prepare."""
    lease = Lease(run.dir)
    with lease.locked(f"deciding a fresh start of run {run.name}"):
        refuse_live_writers(run, None)
        token = int((lease.current() or {}).get("token", 0)) + 1
        decision = _decision(who, token)
        atomic_write_json(
            lease.path,
            {"token": token, "incarnation": folder_incarnation(run.dir), "holder": "", PENDING: decision},
        )
        update_record(run.dir, **{PENDING: decision})
    return decision


def _move_aside(run: Run, decision: dict) -> tuple[Path, int]:
    """Under the run's lock: record in the old run's record where it goes, and move its folder to the archive."""
    lease = Lease(run.dir)
    with lease.locked(f"moving run {run.name} aside for a fresh start"):  # no token is taken while the folder moves
        last_token = int((lease.current() or {}).get("token", 0))
        record = read_record(run.dir)
        record.pop(PENDING, None)
        if record:
            write_record(run.dir, {**record, "archived": {**decision, "at": utc_now()}})
        return archive_run(run.dir, decision["archive"]), last_token


def refuse_live_writers(run: Run, jobs=None) -> list[str]:
    """Refuse (RunError) when a writer of the run may still write: its lease's trainer alive on this host, or a
    live Ray job of the run (with `jobs`). Returns what cannot be seen from here, for the log: a writer on
    another host, or a Ray that does not answer (the lease's fencing keeps such a writer out)."""
    seen: list[str] = []
    unseen: list[str] = []
    writer = run.folder.lease().writer() if run.dir.is_dir() else None
    if writer is not None:
        (seen if writer[0] else unseen).append(f"trainer {writer[1]}")
    if jobs is not None:
        try:
            seen += [f"Ray job {j.submission_id} ({j.status})" for j in jobs.live_jobs_of_run(run.spec.name, run.name)]
        except Exception as e:  # noqa: BLE001 - an unreachable Ray is no reason to refuse: the fencing holds
            unseen.append(f"the run's Ray jobs: Ray did not answer ({str(e).splitlines()[0][:160] if str(e) else e!r})")
    if seen:
        raise RunError(
            f"fresh start of run {run.name!r} refused: it has a live writer: {'; '.join(seen)}",
            "stop it first (`ray job stop ID`, or end the `relay train` process; a DAG run's job ends when "
            "the DAG run is marked failed), then trigger the fresh start again; nothing was moved",
        )
    return [
        f"fresh start of run {run.name}: cannot see whether {w}; whatever it is, its lease token is fenced out "
        "of the new incarnation"
        for w in unseen
    ]


def _incarnations_differ(name: str, run_dir: Path, local: str | None, published: str, store) -> str:
    here = (
        f"the folder {run_dir} holds incarnation {local}"
        if local
        else f"the checkpoint folder {run_dir} holds no run" + (" record" if run_dir.is_dir() else "")
    )
    return (
        f"run {name!r}: {store.uri}/{name}/ holds its incarnation {published}, and {here}; continuing would mix "
        f"two runs under one name (a resume would restore the other run's weights and data position)"
    )


def run_state(run: Run, archived: Path | None = None, archived_uri: str | None = None) -> RunState:
    run_dir = run.dir
    latest, problem = latest_step_or_problem(run_dir)
    nxt = ChunkPlan.from_spec(run.spec).next_chunk(latest)
    return RunState(
        run.name,
        str(run_dir),
        latest or 0,
        run.spec.total_steps,
        nxt.index if nxt else None,
        str(archived) if archived else None,
        problem,
        folder_incarnation(run_dir),
        archived_uri,
    )


def archive_run(run_dir: Path, stamp: str | None = None) -> Path:
    """Move a run folder to <checkpoint_dir>/.archive/<run>-<UTC time>-<random>; nothing is deleted."""
    stamp = stamp or f"{utc_stamp()}-{secrets.token_hex(3)}"
    dest = run_dir.parent / ".archive" / f"{run_dir.name}-{stamp}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    run_dir.rename(dest)
    return dest
