"""Relay's errors. Each one says what failed and what to do next."""

from __future__ import annotations

from relay.common.redaction import redact


class RelayError(Exception):
    """Base class: `what` failed; `fix` tells a person what to do about it. `cause`: how a chunk that
    ends with it is classified (relay.runs.failure_cause): Relay refused to go on, unless the error is one
    of the infrastructure's."""

    exit_code = 1
    cause = "refused"

    def __init__(self, what: str, fix: str | None = None):
        self.what = what = redact(what)
        self.fix = fix = redact(fix) if fix else fix
        super().__init__(what if not fix else f"{what}\n  What to do: {fix}")


class SpecError(RelayError):
    """A run spec is malformed or cannot be run. `key` names the offending key (dotted)."""

    exit_code = 2

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


class RunError(RelayError):
    """A training run cannot be started or continued as asked (bad name, unguarded fresh start...)."""


class CheckpointError(RelayError):
    """A checkpoint is missing, incomplete or inconsistent."""


class DiskFullError(CheckpointError):
    """A checkpoint could not be saved: its volume is full. The partial checkpoint was removed; a retry once
    space is freed resumes from the last one."""

    cause = "infrastructure"


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file would need arbitrary code to load; nothing in it was executed."""


class StoreError(RelayError):
    """S3 is unreachable or refused a request; nothing already saved is lost."""

    cause = "infrastructure"


class LeaseLost(RelayError):
    """Another attempt of this run holds the lease: this process must not write."""

    exit_code = 3


class StoppedEarly(RelayError):
    """A trainer stopped before its chunk's end step because it was asked to (SIGTERM, a stop request, the spec's
    save_before deadline), after committing a checkpoint of the last step it trained, or before training one:
    no step was lost, and the chunk's retry resumes there (relay.trainers.stopping)."""

    exit_code = 4
    cause = "preempted"


class RayJobError(RelayError):
    """The Ray cluster is unreachable, or a chunk's job failed."""

    cause = "infrastructure"
