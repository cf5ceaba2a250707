"""Relay's errors. Each one says what failed and what to do next."""

from __future__ import annotations

from typing import Any

from relay.common.redaction import redact


class RelayError(Exception):
    """Base class: `what` failed; `fix` tells a person what to do about it. `retry_helps`: whether trying again
    as it is can succeed (a server that comes back, a preemption) or cannot (a refusal, a bad input): every
    error class says it, and a bare RelayError is given it where it is raised. `cause`: how a chunk that ends
    with it is classified (relay.runs.failure_cause): infrastructure when a retry helps, refused when not,
    unless the class names another."""

    exit_code = 1
    retry_helps: bool | None = None
    cause = "refused"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "cause" not in cls.__dict__ and "retry_helps" in cls.__dict__:
            cls.cause = "infrastructure" if cls.retry_helps else "refused"

    def __init__(self, what: str, fix: str | None = None, *, retry_helps: bool | None = None):
        self.what = what = redact(what)
        self.fix = fix = redact(fix) if fix else fix
        if retry_helps is not None:  # a bare RelayError: said where it is raised
            self.retry_helps, self.cause = retry_helps, "infrastructure" if retry_helps else "refused"
        super().__init__(what if not fix else f"{what}\n  What to do: {fix}")


class SpecError(RelayError):
    """A run spec is malformed or cannot be run. `key` names the offending key (dotted)."""

    exit_code = 2
    retry_helps = False

    def __init__(self, source: str, key: str, problem: str, fix: str | None = None):
        self.source = source
        self.key = key
        self.problem = problem
        where = f"{source}: key '{key}'" if key else source
        super().__init__(f"run spec {where}: {problem}", fix)


class UsageError(RelayError):
    """What a command was given is not what it takes (a folder that holds no run, a request that does not apply):
    nothing was looked at or changed."""

    exit_code = 2
    retry_helps = False


class RunError(RelayError):
    """A training run cannot be started or continued as asked (bad name, unguarded fresh start...)."""

    retry_helps = False


class CheckpointError(RelayError):
    """A checkpoint is missing, incomplete or inconsistent."""

    retry_helps = False


class DiskFullError(CheckpointError):
    """A checkpoint could not be saved: its volume is full. The partial checkpoint was removed; a retry once
    space is freed resumes from the last one."""

    retry_helps = True


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would need arbitrary code to load; nothing in it was executed."""

    retry_helps = False


class CertificateError(CheckpointError):
    """A resume's recomputed certificate does not match the one its checkpoint was saved with
    (relay.checkpoints.certificate): the trainer does not hold the state that was saved. The checkpoint was
    quarantined and the tracker moved back; a person looks before the run goes on."""

    retry_helps = False


class StoreError(RelayError):
    """S3 is unreachable or refused a request; nothing already saved is lost."""

    retry_helps = True


class LeaseLost(RelayError):
    """Another attempt of this run holds the lease: this process must not write."""

    exit_code = 3
    retry_helps = False


class StoppedEarly(RelayError):
    """A trainer stopped before its chunk's end step because it was asked to (SIGTERM, a stop request, the spec's
    save_before deadline), after committing a checkpoint of the last step it trained, or before training one:
    no step was lost, and the chunk's retry resumes there (relay.trainers.stopping)."""

    exit_code = 4
    retry_helps = True
    cause = "preempted"


class HandoffStopped(StoppedEarly):
    """A job that went on warm into the next chunk stopped without committing any of that chunk's steps: the chunk
    was refused at its admission, not admitted in time, the previous chunk's checkpoint failed the gate, or a stop
    came before the admission (relay.runs.handoff). The chunk's next try starts cold from the latest valid
    checkpoint."""


class RayJobError(RelayError):
    """The Ray cluster is unreachable, or a chunk's job failed."""

    retry_helps = True


class ChunkEndedEarly(RelayError):
    """A trainer ended without an error before its chunk's end step, and without being asked to stop (verl's loop
    returned early): nothing says why, and the retry resumes from the latest valid checkpoint."""

    retry_helps = True
    cause = "unknown"
