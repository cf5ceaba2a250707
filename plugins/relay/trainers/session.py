"""What every trainer does around its loop, whatever the trainer: take or check the run's lease, find
the checkpoint to resume from, keep metrics at one row per step, print progress, and commit each
checkpoint so that a reader never sees a half-written one.

A checkpoint is written into .relay/staging/, made durable (fsync), then, holding the lease lock,
renamed to global_step_N and named by the tracker (written atomically, last). A trainer killed at
any point leaves either the previous checkpoint or the new one as latest, never a partial one.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from relay.checkpoints import certificate, commits
from relay.checkpoints.resume import find_resume_point, quarantine
from relay.checkpoints.validate import Check, CheckReport
from relay.common import files
from relay.common.errors import (
    CertificateError,
    CheckpointError,
    DiskFullError,
    HandoffStopped,
    LeaseLost,
    RunError,
    StoppedEarly,
)
from relay.common.faultpoint import fault_point
from relay.common.progress import PREFIX, step_line
from relay.common.timestamps import process_started
from relay.data.freeze import frozen_files, verify_frozen
from relay.runs import handoff, heartbeat, layout, node_oom
from relay.runs.failure_cause import cgroup_oom_kills
from relay.runs.metrics import MetricsLog, read_events, record_event
from relay.runs.record import folder_incarnation
from relay.runs.run import Run
from relay.s3.restore import restore_for_resume
from relay.spec.plan import ChunkPlan
from relay.trainers.contract import ChunkRequest
from relay.trainers.stopping import GracefulStop


class ChunkSession:
    """What every trainer does around its loop (see the module's docstring): create one at the chunk's start, call
    its methods at each step and save, finish() at the end."""

    # (class defaults: verl's actor session is built without __init__)
    chunks_trained = 1  # chunks this job has trained (warm handoffs + 1), for chunks.restart_every
    awaiting: int | None = None  # the step this job went on warm from, until its chunk is admitted
    _in_flight: threading.Thread | None = None  # the save being written off the critical path
    _in_flight_error: BaseException | None = None

    def __init__(self, req: ChunkRequest, *, forward_stop=None, training_started=None):
        """Take the run's lease (or claim the token a DAG's job was given) and find the checkpoint to resume from."""
        self.req = req
        self.spec = req.spec
        self.run_dir = req.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # From here a SIGTERM ends the process (nothing trained yet); once training, it asks for a graceful stop
        # (relay.trainers.stopping), as the stop file and the spec's save_before do.
        self.stopping = GracefulStop(
            self.run_dir, req.attempt, self.spec.deadline(), forward=forward_stop, started=training_started
        )
        self._save_started: float | None = None
        self._save_s: float | None = None  # what this process's last save took
        self.lease = req.run.folder.lease()
        if req.lease_token is None:
            req.lease_token = self.lease.acquire(f"local:{socket.gethostname()}:{os.getpid()}")
        else:
            self.lease.claim(req.lease_token)
        self.token = req.lease_token
        self.run = replace(req.run, incarnation=self._incarnation())
        # Validated (integrity against the manifest, safe load, numerics) just before the trainer
        # loads it; invalid checkpoints are quarantined and the tracker falls back to a valid one.
        self.resume = find_resume_point(self.run_dir, restore=restore_function(self.run, req.restore))
        self.resume_step = self.resume.step
        for q in self.resume.quarantined:
            if q["path"]:
                self.say(f"quarantined checkpoint step {q['step']}: {q['check']} failed: {q['detail']}")
            else:  # a tracker that names nothing valid: set aside or re-pointed, no checkpoint moved
                self.say(f"refused the tracker: {q['check']} failed: {q['detail']}")
        if self.resume.restored_from:
            self.say(f"restored step {self.resume_step} from {self.resume.restored_from}")
        self.certificate: str | None = None  # the resume's: certified, uncertified (None: from step 0)
        self._no_certificate: dict[int, str] = {}  # step -> why the trainer could not compute its certificate
        self._certify_s: float | None = None  # what recomputing and comparing the certificate took
        self.metrics = MetricsLog(self.run_dir)
        self._t0 = time.time()
        self._chunk_s: float | None = None  # the last chunk this job went on from, start to end (hand_off)
        self._step_times: list[float] = []

    def _incarnation(self) -> str | None:
        """The run's incarnation: the request's (the DAG's and the CLI's, from the run record), which the
        folder's record must agree with; the folder's for a request without one. A folder without a record
        (a new host) restores only checkpoints of the request's incarnation."""
        asked = self.req.run.incarnation
        local = folder_incarnation(self.run_dir)
        if asked and local and local != asked:
            raise RunError(
                f"run {self.req.run}: this chunk belongs to incarnation {asked}, but "
                f"{self.run_dir} now holds incarnation {local} (the run was started again since)",
                "nothing to do: this attempt stops without writing; the run's own chunks go on",
            )
        return asked or local

    # ------------------------------------------------------------------------------ resume
    def resume_checkpoint(self) -> Path | None:
        """The folder to resume from (validated when the session started), or None for step 0."""
        return layout.step_dir(self.run_dir, self.resume_step) if self.resume_step else None

    def certify(self, step_dir: Path, recompute) -> None:
        """Compare the checkpoint's certificate with `recompute(probe_ids)`, the trainer's certificate of what it
        loaded, after loading and before the first step (relay.checkpoints.certificate), as its commit record says it
        should have one (relay.checkpoints.commits). A checkpoint whose commit recorded no certificate, or committed
        before records were kept, resumes uncertified (unless checkpoints.require_certificate); one whose certificate
        does not hold, or was removed or replaced since its commit, is quarantined, the tracker falls back to the
        newest valid checkpoint, and the resume is refused (CertificateError: cause refused)."""
        step = self.resume_step
        assert step is not None
        standing = commits.standing(self.run_dir, step, step_dir)
        if standing.kind == "refused":
            raise self.refuse_resume("certificate", standing.detail)
        if standing.uncertified and self.spec.checkpoints.require_certificate:
            raise self.refuse_resume(
                "certificate", f"it has no certificate ({standing.detail}) and checkpoints.require_certificate is on"
            )
        saved = certificate.read(step_dir)
        if saved is None:
            self.certificate = "uncertified"
            self.say(
                f"uncertified resume from step {step}: {step_dir.name} has no certificate ({standing.detail}); its "
                "files passed validation (checkpoints.require_certificate: true refuses such a resume)"
            )
            return
        t0 = time.perf_counter()
        now = recompute(saved.probe_ids)
        c = certificate.compare(saved, now, self.spec.checkpoints.certificate_tolerance)
        self._certify_s = round(time.perf_counter() - t0, 4)
        if c.ok:
            self.certificate = "certified"
            self.say(
                f"certified resume from step {step}: {c.detail()}; {len(now.params)} parameter digests, the "
                f"optimizer's step and LR, the data position and the RNG states as saved (checked in {self._certify_s:.3f}s)"
            )
            return
        raise self.refuse_resume(
            "certificate", f"its certificate does not hold, the state loaded is not the state saved ({c.detail()})"
        )

    def no_certificate(self, step: int, why: str) -> None:
        """The trainer could not compute step `step`'s certificate: its commit records why (relay.checkpoints.commits),
        and the step may resume uncertified."""
        self._no_certificate[step] = why
        self.say(f"no certificate for step {step} ({why}); its commit records why, and it may resume uncertified")

    def refuse_resume(self, check: str, detail: str) -> CheckpointError:
        """After loading, before the first step: the resume checkpoint failed `check` (the certificate; an async run's
        prompts in flight). It is quarantined, the tracker falls back to the newest valid checkpoint, and the error
        to raise says so (cause refused: the retry resumes from the fallback)."""
        step = self.resume_step
        dest = quarantine(self.run_dir, CheckReport(str(self.run_dir), step, [Check(check, False, detail)]))
        try:
            fell_back: int | None = find_resume_point(self.run_dir).step
        except CheckpointError:
            fell_back = None
        self.record(
            f"{check}_refused",
            step=step,
            chunk=self.req.chunk,
            attempt=self.req.attempt,
            detail=detail,
            quarantined_to=str(dest),
            fell_back_to=fell_back,
        )
        then = (
            f"the tracker now names step {fell_back}, which is checked alike when it is resumed"
            if fell_back
            else "no valid checkpoint is left locally"
        )
        error = CertificateError if check == "certificate" else CheckpointError
        return error(
            f"refused to resume run {self.req.run} from step {step}: {detail}. The checkpoint is quarantined to {dest}; "
            f"{then}",
            f"look at {dest} (how was it changed since its save?); then retry the chunk: it resumes from "
            + (f"step {fell_back}" if fell_back else "a published checkpoint, or needs fresh_start"),
        )

    def data_files(self) -> dict[str, list[str]]:
        """The files to train on: the run's frozen copies, verified by sha256 just before use (fetched
        from S3 if this host lacks them); the spec's sources only for a run never frozen (the CLI)."""

        files = frozen_files(self.run_dir)
        if files is None:
            self.say("this run has no frozen data (never started by its DAG): reading the spec's source files")
            return {"train": list(self.spec.data.train_files), "val": list(self.spec.data.val_files)}
        store = None
        if self.spec.s3 is not None and self.req.restore:
            from relay.s3.store import store_for_spec

            store = store_for_spec(self.spec)
        paths = verify_frozen(self.run_dir, files, store)
        self.say(f"training on frozen data: {', '.join(f'{f.role} {f.sha256[:12]} ({f.rows} rows)' for f in files)}")
        return paths

    def begin(self) -> None:
        """Record the attempt; supersede metrics rows written after the resume point."""
        dropped = self.metrics.resume_at(self.resume_step, self.req.attempt)
        self.record(
            "chunk_start",
            chunk=self.req.chunk,
            attempt=self.req.attempt,
            resumed_from=self.resume_step,
            to_step=self.req.to_step,
            warm=False,
            world_size=self.world_size,
            lease_token=self.token,
            superseded_rows=dropped,
            restored_from=self.resume.restored_from,
            certificate=self.certificate,
            certificate_seconds=self._certify_s,
            quarantined=[q["step"] for q in self.resume.quarantined if q["path"]],
            tracker_refused=[q["detail"] for q in self.resume.quarantined if not q["path"]],
            # evidence for a later SIGKILL: did the OOM killer act meanwhile (relay.runs.failure_cause)
            host=socket.gethostname(),
            oom_kills=cgroup_oom_kills(),
            process_started=process_started(),
        )  # a restart's cost counts from it (relay.insights.save_interval)
        self._node_oom_census()
        where = f"step {self.resume_step}" if self.resume_step else "scratch (step 0)"
        if self.certificate:
            where += f" ({self.certificate})"
        self.say(
            f"run {self.req.run}: chunk {self.req.chunk or '-'} resumes from {where}, "
            f"trains to step {self.req.to_step} of {self.spec.total_steps} (attempt {self.req.attempt}, "
            f"lease token {self.token})"
        )

    # ------------------------------------------------------------------------------ progress
    def record(self, event: str, **fields) -> dict | None:
        """A run event of this attempt, written only while its token holds the lease in its incarnation: checked
        without the lock, so a per-step write never waits behind a slow holder. A writer fenced out (a newer
        attempt, a fresh start) writes nothing into the run, not even why it stops: None."""
        try:
            self.lease.check(self.token)
        except LeaseLost:
            return None
        life = {"incarnation": self.lease.incarnation} if self.lease.incarnation else {}
        return record_event(self.run_dir, event, **life, **fields)

    @property
    def world_size(self) -> int | None:
        """The processes this job trains with: an elastic spec's chosen size, else the spec's (None: not said)."""
        return self.req.world_size or self.spec.core_settings.world_size

    @staticmethod
    def say(msg: str) -> None:
        """A progress line on stdout, marked as Relay's."""
        print(f"{PREFIX}{msg}", flush=True)

    def step_done(self, step: int, seconds: float, **values: float) -> None:
        """One metrics row and one progress line per step; stop at once if the lease was lost."""
        self.lease.check(self.token)
        if self.awaiting is not None:
            self._check_admission(step, wait=False)
        self._step_times.append(seconds)
        row = {
            "step": step,
            "chunk": self.req.chunk,
            "attempt": self.req.attempt,
            "seconds": round(seconds, 4),
            "time": time.time(),
            **values,
        }
        self.metrics.append(row)
        heartbeat.beat(self.run_dir, self.req.attempt, step)
        self.say(step_line(step, self.spec.total_steps, self.req.chunk, self.req.to_step, self._step_times[-20:], values))
        fault_point("after_step", step)

    # ------------------------------------------------------------------------------ graceful stops
    def stop_reason(self, this_step_s: float | None = None) -> str | None:
        """Why the trainer should save and stop before its next step (SIGTERM, a stop request, save_before),
        None to train on (relay.trainers.stopping). this_step_s: what the step just trained took, when its row
        is not recorded yet (verl records it after its step's end)."""
        steps = self._step_times + ([this_step_s] if this_step_s is not None else [])
        return self.stopping.check(steps, self._save_s if self._save_s is not None else last_save_seconds(self.run_dir))

    def record_stop(self, step: int, reason: str) -> None:
        """The `chunk_stopped` event: this attempt stopped as asked, its last checkpoint at `step`."""
        self.record(
            STOPPED_EVENT,
            chunk=self.req.chunk,
            attempt=self.req.attempt,
            step=step,
            reason=reason,
            resumed_from=self.resume_step,
        )

    def stopped_early(self, step: int, reason: str, *, record: bool = True) -> StoppedEarly:
        """The error that ends a chunk stopped as asked after committing step `step` (or before training one);
        record=False when the trainer recorded the stop itself (verl's, in its actor)."""
        self.wait_for_save()
        if record:
            self.record_stop(step, reason)
        trained = step - self.resume_step
        what = (
            f"stopped after step {step} ({reason}): its checkpoint global_step_{step} is committed, no step lost"
            if trained
            else f"stopped before training a step ({reason}): nothing to save, no step lost"
        )
        return StoppedEarly(
            f"{what}; {self.req.to_step - step} step(s) of the chunk left",
            f"nothing: the chunk's retry resumes from step {step}",
        )

    # ------------------------------------------------------------------------------ checkpoints
    def staging_dir(self, step: int) -> Path:
        """A fresh folder to write global_step_<step> into; stale staging of dead attempts is removed."""
        self.lease.check(self.token)
        staging_root = layout.relay_dir(self.run_dir, "staging")
        staging_root.mkdir(parents=True, exist_ok=True)
        mine = staging_root / f"{layout.step_name(step)}.t{self.token}"
        for old in staging_root.iterdir():
            token = old.name.rpartition(".t")[2]
            # Only older attempts' leftovers: a newer attempt's staging is never touched.
            if old == mine or (token.isdigit() and int(token) < self.token):
                shutil.rmtree(old, ignore_errors=True)
        return mine

    @contextmanager
    def saving(self, step: int) -> Iterator[Path]:
        """The staging folder to write checkpoint <step> into (see staging_dir). A write that fails removes
        it, so a failed save never leaves the disk fuller than before; a full disk is said plainly, with
        the checkpoint the run still has and what to do."""
        if self.awaiting is not None:  # a warm chunk commits nothing before its train task admitted it
            self._check_admission(step, wait=True)
        staged = self.staging_dir(step)
        self._save_started = time.time()
        try:
            yield staged
        except BaseException as e:
            failed = self._save_failed(step, staged, e)
            if failed is e:
                raise
            raise failed from e

    def _save_failed(self, step: int, staged: Path, e: BaseException) -> BaseException:
        """What a failed save raises, once its staging folder is removed: a full disk said plainly, else the error."""
        free = _free_bytes(self.run_dir)
        shutil.rmtree(staged, ignore_errors=True)
        if not _disk_full(e, free):
            return e
        last = layout.read_tracker(self.run_dir)
        return DiskFullError(
            f"the checkpoint disk is full: saving step {step} under {self.run_dir} failed ({e.__class__.__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else 'no space left'}; {free / 2**20:.1f} MiB free when it "
            f"failed). The partial checkpoint was removed; the tracker still names "
            f"{f'step {last}' if last else 'no checkpoint'}, which is intact",
            f"free space on that volume (or lower checkpoints.keep_local), then retry the chunk: it resumes from "
            f"{f'step {last}' if last else 'step 0'}",
        )

    def save_off_critical_path(
        self,
        step: int,
        snapshot: Callable[[Path], Callable[[], Path | None]],
        sync: Callable[[Path], None] | None = None,
    ) -> None:
        """Save step `step` while training goes on (checkpoints.async_save, relay.trainers.async_save): on this
        thread, `snapshot(staged)` copies what the save writes into host buffers (the trainer's save code, its
        barriers and the certificate's probe included: the blocking time) and returns the writes; a thread of its
        own writes them, fsyncs and commits under the lease (the token re-checked); the writes return the step
        folder to commit when it is not `staged` itself (verl writes global_step_N inside it). At most one save
        is in flight: this first waits for the one before. A copy that does not fit in the host's memory
        (NoRoomForCopy) is saved here, with `sync(staged)`, as a synchronous save."""
        from relay.trainers.async_save import NoRoomForCopy

        self.wait_for_save()
        with self.saving(step) as staged:
            t0 = time.time()
            try:
                write = snapshot(staged)
            except NoRoomForCopy as e:
                if sync is None:
                    raise
                self.say(f"step {step} is saved synchronously: {e}")
                shutil.rmtree(staged, ignore_errors=True)
                staged.mkdir(parents=True)
                sync(staged)
                self.commit(step, staged)
                return
            blocking = round(time.time() - t0, 4)
        self._in_flight = threading.Thread(
            target=self._write_and_commit, args=(step, staged, write, blocking, time.time()), name=f"relay-save-{step}"
        )
        self._in_flight.start()

    def _write_and_commit(
        self, step: int, staged: Path, write: Callable[[], Path | None], blocking: float, until: float
    ) -> None:
        try:
            folder = write() or staged
            self.commit(step, folder, blocking=(blocking, until))
            if folder != staged:
                shutil.rmtree(staged, ignore_errors=True)
        except BaseException as e:  # noqa: BLE001 - raised on the trainer's thread by wait_for_save
            self._in_flight_error = self._save_failed(step, staged, e)

    def wait_for_save(self) -> None:
        """Wait for the save in flight, if any, to be committed; its failure is raised here."""
        thread, self._in_flight = self._in_flight, None
        if thread is None:
            return
        thread.join()
        error, self._in_flight_error = self._in_flight_error, None
        if error is not None:
            raise error

    def commit(self, step: int, staged: Path, *, blocking: tuple[float, float] | None = None) -> Path:
        """Publish a staged checkpoint as global_step_<step> and point the tracker at it (lease-fenced). blocking: a
        save off the critical path's (seconds training waited for it, when that wait ended)."""
        fault_point("before_fsync", step)
        files.fsync_tree(staged)
        final = layout.step_dir(self.run_dir, step)
        with self.lease.commit(self.token):
            fault_point("before_rename", step)
            if final.exists():
                # Left by an attempt killed after its rename but before its tracker write: never
                # named by the tracker, so never resumed from. Kept aside, not deleted.
                aside = layout.relay_dir(self.run_dir, "superseded", f"{final.name}.{int(time.time() * 1e3)}")
                aside.parent.mkdir(parents=True, exist_ok=True)
                final.rename(aside)
            staged.rename(final)
            files.fsync_dir(self.run_dir)
            fault_point("after_rename", step)
            # Outside the step folder, before the tracker names the step: its certificate cannot be removed unseen.
            committed = commits.write(
                self.run_dir, step, final, skipped=self._no_certificate.pop(step, None), by=self.req.attempt
            )
            layout.write_tracker(self.run_dir, step)
            fault_point("after_tracker", step)
        started = self._save_started
        self._save_s = round(time.time() - started, 3) if started else None
        # The ledger's save is what training waited for: the whole save, or an async save's copy alone.
        timing = (
            {"seconds": self._save_s}
            if blocking is None
            else {"seconds": blocking[0], "blocking_until": blocking[1], "written_seconds": self._save_s}
        )
        self.record(
            "checkpoint",
            step=step,
            chunk=self.req.chunk,
            attempt=self.req.attempt,
            certificate=commits.summary(committed),
            **timing,
        )
        self.say(f"checkpoint global_step_{step} committed; tracker -> {step}")
        return final

    # ------------------------------------------------------------------------------ warm handoff
    def hand_off(self, step: int) -> bool:
        """After committing the chunk's end step `step`: go on warm into the next chunk (True) or end the job
        (False). Warm when the spec asks for it, a next chunk exists, chunks.restart_every is not reached and
        no stop was asked; the chunk's end and the next chunk's start are recorded as for a new job
        (`chunk_start` with `warm: true`), and nothing of the next chunk is committed before its train task
        admits it (relay.runs.handoff)."""
        self.wait_for_save()  # the chunk's end is committed before the chunk ends
        spec, chunk = self.spec, self.req.chunk
        if not self.req.handoff or not spec.warm_chunks or chunk is None or step >= spec.total_steps:
            return False
        if spec.chunks.restart_every and self.chunks_trained >= spec.chunks.restart_every:
            self.say(
                f"chunk {chunk} ends this job: a fresh one every {spec.chunks.restart_every} chunk(s) (chunks.restart_every)"
            )
            return False
        if (why := self.stop_reason()) is not None:
            self.say(f"chunk {chunk} ends this job ({why}): the next chunk starts cold")
            return False
        self.finish_chunk(step, handoff="warm")
        nxt = ChunkPlan.from_spec(spec).chunk_for_step(step + 1)
        self.req.chunk, self.req.to_step = nxt.index, nxt.end_step
        self.resume_step, self.awaiting, self.certificate, self._certify_s = step, step, None, None
        self.chunks_trained += 1
        self._chunk_s = time.time() - self._t0  # the chunk it went on from: what its admission limit follows
        self._t0 = time.time()
        handoff.went_warm(
            self.run_dir,
            nxt.index,
            attempt=self.req.attempt,
            from_step=step,
            token=self.token,
            spec=handoff.spec_digest(spec.to_json()),
            chunk_seconds=round(self._chunk_s, 3),
        )
        self.record(
            "chunk_start",
            chunk=nxt.index,
            attempt=self.req.attempt,
            resumed_from=step,
            to_step=nxt.end_step,
            warm=True,
            world_size=self.world_size,
            lease_token=self.token,
            superseded_rows=0,
            host=socket.gethostname(),
        )
        self._node_oom_census()
        self.say(
            f"run {self.req.run}: chunk {nxt.index} starts warm from step {step} in this job (no start-up), trains to "
            f"step {nxt.end_step} of {spec.total_steps}; it commits once its train task admits it"
        )
        return True

    def _node_oom_census(self) -> None:
        """Where the trainer runs inside Ray (verl's): every node's kernel OOM-kill count as the chunk starts, the
        evidence a later killed worker is judged by (relay.runs.node_oom), read on a thread of its own and recorded
        as the `node_oom_census` event: the chunk's training never waits for it."""
        if not node_oom.connected():
            return
        chunk, attempt = self.req.chunk, self.req.attempt

        def census() -> None:
            if counts := node_oom.census_if_connected():
                self.record(node_oom.EVENT, chunk=chunk, attempt=attempt, node_oom_kills=counts)

        threading.Thread(target=census, name="relay-node-oom-census", daemon=True).start()

    def _check_admission(self, step: int, *, wait: bool) -> None:
        """A warm chunk's admission: go on once admitted (its train task took it over); stop without committing
        when it was refused, the checkpoint it went on from is no longer the run's latest (the gate quarantined
        it), a stop is asked before the admission, or (wait=True: at its first save) none came in time."""
        chunk, from_step = self.req.chunk, self.awaiting
        assert chunk is not None and from_step is not None
        began = time.time()
        limit = handoff.admission_limit_s(self.spec.chunks.admission_timeout_minutes, self._chunk_s)
        until = began + limit
        said = False
        while True:
            # Fenced first: after a fresh start (or a newer attempt's lease) this job writes nothing into the run,
            # not even its refusal, and stops as a lost lease does (exit 3), not as a stop a retry can help.
            self.lease.check(self.token)
            got = handoff.answer(self.run_dir, chunk, self.req.attempt)
            if got is not None and got.get("admitted"):
                self.awaiting = None
                self.say(f"chunk {chunk} admitted by {got.get('by')}: it commits under lease token {self.token}")
                if said:  # the job waited for its admission: a part of the handoff (relay.insights.goodput)
                    self.record(
                        "handoff_wait",
                        chunk=chunk,
                        attempt=self.req.attempt,
                        step=step,
                        seconds=round(time.time() - began, 3),
                    )
                return
            why = None
            if got is not None:
                why = f"it was refused: {got.get('why')}"
            elif layout.read_tracker(self.run_dir) != from_step or not layout.step_dir(self.run_dir, from_step).is_dir():
                why = f"checkpoint {from_step}, which it went on from, is no longer the run's latest (the gate refused it?)"
            elif (stop := self.stop_reason()) is not None:
                why = f"{stop} before its train task admitted it"
            elif wait and time.time() > until:
                why = f"no admission within {limit / 60:.1f} min (chunks.admission_timeout_minutes)"
            if why is not None:
                self.record(
                    "handoff_refused",
                    chunk=chunk,
                    attempt=self.req.attempt,
                    step=step,
                    from_step=from_step,
                    why=why,
                )
                self.record_stop(step, f"warm chunk not admitted: {why}")
                raise HandoffStopped(
                    f"chunk {chunk} went on warm from step {from_step} and trained to step {step}, but {why}: nothing "
                    f"of it was committed; the tracker still names step {layout.read_tracker(self.run_dir)}",
                    f"nothing: chunk {chunk}'s try starts a new job from the latest valid checkpoint",
                )
            if not wait:
                return
            if not said:
                self.say(f"chunk {chunk}: waiting for its train task's admission before committing step {step}")
                heartbeat.beat(self.run_dir, self.req.attempt, step, waiting=True)  # its follow task's stall watch
                said = True
                fault_point("awaiting_admission", step)  # the fault suite's kill of a job waiting here
            time.sleep(0.2)

    def finish_chunk(self, end_step: int, **fields) -> None:
        """Record the chunk's end (events.jsonl: chunk_end) with how long it took."""
        self.record(
            "chunk_end",
            chunk=self.req.chunk,
            attempt=self.req.attempt,
            end_step=end_step,
            seconds=round(time.time() - self._t0, 3),
            **fields,
        )

    def finish(self, end_step: int) -> None:
        """The chunk's end: wait for the last save's commit, stop the stop watch and the metrics, record the end."""
        self.wait_for_save()  # a chunk never ends before its last save is committed
        self.stopping.close()
        self.metrics.close()
        heartbeat.clear(self.run_dir, self.req.attempt)
        self.finish_chunk(end_step)


STOPPED_EVENT = "chunk_stopped"


def stop_of(run_dir: Path, attempt: str) -> dict | None:
    """The attempt's `chunk_stopped` event, if it stopped as asked."""
    return next(
        (e for e in reversed(read_events(run_dir)) if e.get("event") == STOPPED_EVENT and e.get("attempt") == attempt), None
    )


def last_save_seconds(run_dir: Path) -> float | None:
    """What the run's newest save took (its `checkpoint` event: staging to the tracker's commit), if recorded."""
    return next(
        (
            float(e["seconds"])
            for e in reversed(read_events(run_dir))
            if e.get("event") == "checkpoint" and isinstance(e.get("seconds"), (int, float))
        ),
        None,
    )


def _disk_full(e: BaseException | None, free: int) -> bool:
    """Did this write fail for lack of space? Python says OSError ENOSPC (or EDQUOT, a quota); torch.save's
    zip writer says only "unexpected pos" or "file write failed", so that counts when the disk is near full."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(m in str(e) for m in ("No space left on device", "Disk quota exceeded")):
            return True
        if free < NEAR_FULL and any(m in str(e) for m in ("unexpected pos", "file write failed")):
            return True
        e = e.__cause__ or e.__context__
    return False


NEAR_FULL = 64 * 2**20


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def restore_function(run: Run, restore: bool = True):
    """Restore from the run's published checkpoints of its own incarnation when the spec names a store; None
    otherwise, and for a run of unknown incarnation (a new folder: nothing published can be its own)."""
    if run.spec.s3 is None or not restore or not run.incarnation:
        return None
    return lambda _run_dir, above=0: restore_for_resume(run, above)  # _run_dir is run.dir


def pin_threads(threads: int) -> None:
    """Pin math threads: a sum over many floats differs between thread counts, so bitwise resume needs it."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(threads)
