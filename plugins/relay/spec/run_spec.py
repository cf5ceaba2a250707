"""RunSpec: one YAML file per training run, validated with errors that name the offending key.

A spec describes a run once: its trainer and settings, step budget and chunk size, seed, where its
checkpoints live, its data, the Ray connection, the S3 target and who is alerted. Keys marked
resume-critical (see specmodel.critical) must not change between the chunks of a run.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import reprlib
import tempfile
from collections.abc import Iterator
from datetime import date, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator

from relay.common import project, redaction
from relay.common.errors import SpecError
from relay.spec.causes import CAUSES, POLICIES
from relay.spec.kinds import KINDS, CoreSettings, TrainerSettings, unknown_kind
from relay.spec.model import StrictModel, critical, critical_values

NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
SCHEDULE_PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly")
CRON_PATTERN = r"(\S+\s+){4}\S+"
DATE_TEMPLATES = {"ds": "%Y-%m-%d", "ds_nodash": "%Y%m%d"}  # the logical date, as Airflow names it
TEMPLATE = re.compile(r"\{\{\s*([A-Za-z_]\w*)\s*\}\}")
S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9!_.*'()/-]*)?$"


class TrainerSpec(StrictModel):
    """`trainer`: the kind (relay.spec.kinds) and its settings, validated by the kind's model."""

    kind: str = critical(description="one of: " + ", ".join(KINDS))
    settings: dict[str, Any] = critical(default_factory=dict, description="the trainer kind's settings (below)")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        if v not in KINDS:
            raise ValueError(unknown_kind(v))
        return v

    def typed_settings(self) -> TrainerSettings:
        """The settings as the kind's model (a TrainerSettings) reads them."""
        return KINDS[self.kind].settings_model().model_validate(self.settings)


class DataSpec(StrictModel):
    """`data`: the training and validation files, their expectations, and what to do when a source changes."""

    train_files: list[str] = critical(
        min_length=1,
        description=(
            "parquet files in verl's RL schema (relative paths: to the project root); frozen into the run folder at the "
            "first chunk"
        ),
    )
    val_files: list[str] = critical(default_factory=list, description="held-out parquet files, frozen alike")
    on_source_change: Literal["fail", "use_frozen"] = Field(
        "fail",
        description="when a source file changes under a run: fail (say what changed), or continue on "
        "the frozen copy with a warning and an alert",
    )
    expectations: list[str] = Field(
        default_factory=list, description="extra great-expectations files, from include/expectations/"
    )


class KeepBest(StrictModel):
    """Keep the k best validated checkpoints by a metric of their step's metrics.jsonl row."""

    metric: str = Field(description="a metric of metrics.jsonl, e.g. val/reward_mean or reward_mean")
    mode: Literal["max", "min"] = Field("max", description="max: the higher the metric, the better")
    k: int = Field(default=1, ge=1, description="how many of the best are kept")


class CheckpointPolicy(StrictModel):
    """Validation, publication and retention of a run's checkpoints (none of it is resume-critical)."""

    validate_on: Literal["worker", "ray"] = Field(
        default="worker",
        description="where validation reads the files: the Airflow worker (storage mounted there) "
        "or a Ray job on the cluster",
    )
    smoke: bool = Field(
        default=True,
        description="also run the trainer's forward-pass smoke check and its offline certificate check (the CPU "
        "trainer's at world size 1; verl's at any world size, shards under 2 GiB): the gate loads the model",
    )
    certificate_tolerance: float = Field(
        default=1e-3,
        ge=0,
        description=(
            "at a resume, the largest difference allowed between the probe's log-probs as saved and as recomputed "
            "after a reshard or on another device kind (exact otherwise; relay.checkpoints.certificate)"
        ),
    )
    require_certificate: bool = Field(
        default=False,
        description=(
            "refuse to resume from a checkpoint without a certificate (its commit recorded why there is none, or it "
            "was committed before the run kept commit records) as from one whose certificate fails; a certificate "
            "removed or replaced since its commit is refused whatever this says"
        ),
    )
    offline_tolerance: float = Field(
        default=0.02,
        ge=0,
        description=(
            "the largest difference allowed between the probe's log-probs as the trainer certified them and as "
            "computed offline, without FSDP: the gate's certificate check and a Hugging Face export's (another "
            "forward path and dtype: verl's mixed precision, the merger's bfloat16); the parameters' digests "
            "are compared exactly all the same"
        ),
    )
    certificate_before_publish: bool = Field(
        default=False,
        description=(
            "publish only checkpoints whose certificate the gate checked offline (the model loaded and compared); "
            "one it could not check (no certificate, a trainer without an offline check) is kept but not published"
        ),
    )
    async_save: bool = Field(
        default=False,
        description=(
            "save off the critical path: the trainer copies the state into host buffers (kept from one save to the "
            "next) and trains on while a thread writes, fsyncs and commits it; the same bytes on disk; at most one "
            "save in flight, a copy that does not fit in host memory saved synchronously. Both trainers: verl's FSDP "
            "workers copy their shards and write them on threads of their own, and the commit waits for every rank"
        ),
    )
    keep_local: int = Field(default=3, ge=1, description="validated and published checkpoints kept on local storage")
    keep_published: int = Field(default=5, ge=1, description="newest published checkpoints kept in S3")
    milestone_every: int = Field(
        default=0,
        ge=0,
        description="every N steps is a milestone: kept forever, exported to Hugging Face format (0: only the final step)",
    )
    delete_grace_minutes: float = Field(default=60, ge=0, description="S3 deletions wait this long after being decided")
    hf_export: bool = Field(default=True, description="publish a Hugging Face model for milestones and the final step")
    keep_best: KeepBest | None = Field(
        default=None,
        description=(
            "also keep the k best validated checkpoints by a metric of their step, locally and in S3, besides the "
            "newest and the milestones ({metric: val/reward_mean, mode: max, k: 2})"
        ),
    )
    on_world_size_change: Literal["refuse", "reshard"] = Field(
        default="refuse",
        description=(
            "when the spec's world size (nnodes x n_gpus_per_node) differs from the latest checkpoint's: refuse the "
            "resume, or reshard the checkpoint to the spec's world size before the chunk's job (relay checkpoint "
            "reshard; the original is kept, the change recorded and alerted once)"
        ),
    )
    mtbf_hours: float | None = Field(
        default=None,
        gt=0,
        description=(
            "the cluster's mean time between failures, for the save interval `relay doctor` and the report advise "
            "(relay.insights.save_interval); empty: observed in the run"
        ),
    )

    def is_milestone(self, step: int, total_steps: int) -> bool:
        """Whether `step` is a milestone: kept in S3 for good and exported to Hugging Face's format."""
        return step == total_steps or bool(self.milestone_every and step % self.milestone_every == 0)


class ChunkPolicy(StrictModel):
    """How one chunk hands over to the next (none of it is resume-critical: a warm and a cold run are the same run)."""

    handoff: Literal["warm", "cold"] | None = Field(
        default=None,
        description=(
            "warm: a chunk's job that ends without a failure goes on with the next chunk's steps, which that chunk's "
            "train task admits (its checks) and adopts; no start-up is paid again. cold: every chunk is a new job "
            "that resumes from the latest valid checkpoint. Empty: warm where the run can be (not in verl_ppo's "
            "supervised mode, which is one job already, nor with a verl save_freq that does not divide chunk_steps)"
        ),
    )
    restart_every: int = Field(
        default=0,
        ge=0,
        description="with handoff warm: a fresh job every N chunks (stacks that leak memory over a long job); 0: never",
    )
    admission_timeout_minutes: float | None = Field(
        default=None,
        gt=0,
        description=(
            "with handoff warm: how long a job that went on into the next chunk may go unadmitted by that chunk's "
            "train task; then it stops without committing and the chunk's try starts cold. Default: twice the "
            "measured duration of the chunk it went on from, at least 5 minutes"
        ),
    )


class AuditSpec(StrictModel):
    """The replay audit of steps trained twice (relay.insights.audit)."""

    tolerance: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "the absolute difference allowed per metric between a step trained again after a resume and its first "
            "try; '*' for every metric not named; empty: exact (Relay's CPU trainer and verl's CPU path are exact; "
            "verl's generation on GPUs need not be)"
        ),
    )

    @field_validator("tolerance")
    @classmethod
    def _not_negative(cls, v: dict[str, float]) -> dict[str, float]:
        if bad := sorted(k for k, x in v.items() if not x >= 0):
            raise ValueError(f"tolerance of {', '.join(bad)} must be 0 or more")
        return v


class ApprovalSpec(StrictModel):
    """Decisions asked in the Airflow UI (airflow.approvals; relay.airflow.decisions)."""

    max_steps_lost: int | None = Field(
        default=None,
        ge=0,
        description=(
            "a chunk whose newest checkpoint was quarantined goes on unattended when falling back to the newest valid "
            "one loses at most this many steps, and asks otherwise (resume from step K, or stop the run); empty: two "
            "chunks' steps"
        ),
    )
    timeout_minutes: float = Field(
        default=1440,
        gt=0,
        description=(
            "a decision not made within this time stops the DAG run (nothing is changed); trigger again to be asked again"
        ),
    )

    def steps_allowed(self, chunk_steps: int) -> int:
        """The steps a fallback may train again without asking a person (max_steps_lost; 2 x chunk_steps by default)."""
        return self.max_steps_lost if self.max_steps_lost is not None else 2 * chunk_steps


class RaySpec(StrictModel):
    """`ray`: the Airflow connection to the Ray dashboard, and how a chunk's job is run, followed and stopped."""

    conn_id: str = Field(default="relay_ray", description="Airflow connection naming the Ray dashboard (Jobs API)")
    python: str = Field(default="python", description="interpreter the job's entrypoint runs on the cluster")
    entrypoint_num_cpus: float = Field(default=1, ge=0, description="CPUs the job's driver reserves on the cluster")
    entrypoint_resources: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "custom Ray resources the job's entrypoint (the trainer's driver) needs, e.g. {trainer_node: 1} to "
            "keep it off the head node"
        ),
    )
    chunk_timeout_minutes: float = Field(default=120, gt=0, description="a chunk's job is stopped after this long")
    poll_seconds: float = Field(default=2.0, gt=0, description="how often the train task's trigger asks Ray about its job")
    stop_grace_seconds: int = Field(
        default=120,
        ge=0,
        description=(
            "how long a chunk's job that is stopped may take to finish its step and save it before it is killed: "
            "Relay's own stops (a stall, the chunk's timeout, a newer try) wait this long for it, and `ray job stop` "
            "too (Ray's RAY_JOB_STOP_WAIT_TIME_S in the job's environment; Ray's own default is 3 s)"
        ),
    )
    env_vars: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "extra environment for the chunk's job; a secret is written as ${VAR} (or ${VAR:-default}), expanded "
            "from the submitting worker's environment only when the job is submitted, and masked in logs and alerts"
        ),
    )


class ElasticSpec(StrictModel):
    """`elastic`: how a run whose world size is a range (verl's nnodes or n_gpus_per_node as [min, max]) follows its
    cluster (docs/guides/elastic.md)."""

    wait_for_nodes_minutes: float = Field(
        default=5,
        ge=0,
        description=(
            "after a node is lost, how long a chunk's retry waits for the cluster to hold the world size it lost "
            "before it goes on at the largest one the cluster holds (never below the minimum)"
        ),
    )
    poll_seconds: float = Field(default=15, gt=0, description="how often a waiting chunk asks the cluster what it holds")


class S3Spec(StrictModel):
    """`s3`: where the run's checkpoints are published, and through which Airflow connection."""

    conn_id: str = Field("aws_default", description="Airflow connection (Amazon provider) of the S3 endpoint")
    uri: str = Field(pattern=S3_URI_PATTERN, description="s3://bucket/prefix that runs are published under")
    part_size_mb: int = Field(32, ge=5, le=5120, description="multipart part size")
    concurrency: int = Field(4, ge=1, le=64, description="parts uploaded at once")
    server_side_encryption: Literal["AES256", "aws:kms"] | None = Field(
        None, description="ask S3 to encrypt every object Relay writes"
    )
    kms_key_id: str | None = Field(None, description="the KMS key of server_side_encryption: aws:kms")
    acl: Literal["bucket-owner-full-control", "private"] | None = Field(
        None, description="canned ACL of every object Relay writes"
    )

    @field_validator("uri")
    @classmethod
    def _plain_prefix(cls, v: str) -> str:
        prefix = v[len("s3://") :].partition("/")[2].rstrip("/")
        if prefix and any(p in ("", ".", "..") for p in prefix.split("/")):
            raise ValueError(
                f"the prefix of {v} has an empty, '.' or '..' part, which an S3 server that maps keys "
                f"to paths may resolve outside the prefix; write the prefix without them"
            )
        return v

    @field_validator("kms_key_id")
    @classmethod
    def _kms_needs_sse_kms(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("server_side_encryption") != "aws:kms":
            raise ValueError("kms_key_id is only used with server_side_encryption: aws:kms; set both, or neither")
        return v


class AlertSpec(StrictModel):
    """Who hears about a failure, and how. Secrets (webhook URLs, SMTP passwords) live in Airflow
    connections: the spec names the connections, never what is in them."""

    email: list[str] = Field(default_factory=list, description="addresses mailed on an alert")
    smtp_conn_id: str = Field(default="smtp_default", description="Airflow connection (SMTP provider) that mails alerts")
    slack_conn_id: str | None = Field(default=None, description="Airflow connection of a Slack incoming webhook")
    webhook_conn_id: str | None = Field(default=None, description="Airflow connection (HTTP provider) of a JSON webhook")
    on_retry: bool = Field(default=False, description="also alert on each retry, not only once per failure event")
    recovery: bool = Field(default=True, description="say so when a run that alerted succeeds again")
    on_finish: bool = Field(
        default=False,
        description="also say when a run finishes, with its goodput: where its wall "
        "time went and what its failures cost (relay.insights.goodput)",
    )
    stall_minutes: float | None = Field(
        default=None,
        gt=0,
        description="a chunk with no new step for this long is stalled: alerted, its job stopped and "
        "retried. Empty: stall_factor x the run's median step time, at least "
        "stall_floor_minutes",
    )
    stall_factor: float = Field(default=20, gt=1, description="see stall_minutes")
    stall_floor_minutes: float = Field(default=5, gt=0, description="see stall_minutes")
    startup_minutes: float = Field(
        default=20,
        ge=0,
        description="allowed before a job's first step, on top of the stall limit (imports, model build, resume)",
    )
    deadline: str | None = Field(
        default=None,
        description=(
            "when the run should be done (ISO 8601 with its zone, epoch seconds, or ${VAR} of Airflow's environment): "
            "each chunk's train task alerts once when the run's ETA (its median step time and chunk overhead) is past "
            "it, and Airflow's deadline alert says so if a DAG run is still going at it (relay.insights.eta)"
        ),
    )

    @field_validator("deadline")
    @classmethod
    def _a_deadline(cls, v: str | None) -> str | None:
        if v is not None and not project.variables(v):
            try:
                deadline_seconds(v, key="alerts.deadline")
            except SpecError as e:
                raise ValueError(e.problem + "; " + (e.fix or "")) from None
        return v


class AirflowSpec(StrictModel):
    """`airflow`: the DAG's schedule, retries, pools, approvals and the retry policy by failure cause."""

    retries: int = Field(
        default=2,
        ge=0,
        description="retries of a failed task (a chunk's train task resumes from the latest valid checkpoint)",
    )
    retry_delay_seconds: float = Field(default=30, ge=0, description="the wait before a retry")
    retry_on: dict[str, Literal["retry", "backoff", "stop"]] = Field(
        default_factory=dict,
        description="what a failed chunk's train task does, by its cause "
        "(relay.runs.failure_cause; docs/guides/failures.md has the defaults): retry, "
        "backoff (retry after retry_backoff_seconds) or stop (no retry)",
    )
    retry_backoff_seconds: float = Field(
        default=300, ge=0, description="the wait before a `backoff` retry, on top of retry_delay_seconds"
    )
    max_active_runs: int = Field(
        default=1, gt=0, description="DAG runs at once (one GPU cluster is shared); a backfill has its own --max-active-runs"
    )
    schedule: str | None = Field(
        default=None,
        description="cron expression or preset (@daily, @weekly...): each DAG run is then a training run "
        "of its own, <name>-<logical date>, with its own checkpoints and frozen data; data "
        "paths may name the date as {{ ds }} or {{ ds_nodash }}",
    )
    start_date: date = Field(default=date(2025, 1, 1), description="the first interval of a schedule")
    catchup: bool = Field(default=False, description="create the runs of past intervals when the DAG appears")
    pool: str | None = Field(
        default="relay_trainers",
        description="Airflow pool of the train tasks: its slots, with "
        "deferred tasks counted, are the trainers a cluster runs "
        "at once, whatever triggered the runs",
    )
    tags: list[str] = Field(default_factory=list, description="more tags of the DAG (it is always tagged relay)")
    approvals: bool = Field(
        default=True,
        description="ask a person in the UI (Required Actions) before a fresh start "
        "of a run with checkpoints, a resume-critical settings change, "
        "or a fallback that loses more than approvals.max_steps_lost "
        "steps; off: refused as before (see approvals)",
    )

    @field_validator("retry_on")
    @classmethod
    def _known_causes(cls, v: dict[str, str]) -> dict[str, str]:
        if unknown := sorted(set(v) - set(CAUSES)):
            raise ValueError(
                f"unknown cause(s) {', '.join(unknown)}; the causes are {', '.join(CAUSES)} "
                f"and the policies {', '.join(POLICIES)}"
            )
        return v

    @field_validator("schedule")
    @classmethod
    def _cron_or_preset(cls, v: str | None) -> str | None:
        if v is None or v in SCHEDULE_PRESETS or re.fullmatch(CRON_PATTERN, v.strip()):
            return v
        raise ValueError(
            f"not a cron expression or preset: {v!r}; use five cron fields ('0 3 * * 1') or one of "
            f"{', '.join(SCHEDULE_PRESETS)}"
        )


class RunSpec(StrictModel):
    """A run spec (include/runs/*.yaml): the trainer and its settings, the steps and chunks, data, checkpoints, Ray,
    S3, alerts and Airflow."""

    name: str = Field(pattern=NAME_PATTERN, description="the spec's name; its DAG is relay_<name>")
    description: str = Field("", description="a line shown as the DAG's description")
    trainer: TrainerSpec = Field(description="what trains: a trainer kind and its settings")
    total_steps: int = critical(gt=0, description="the run's optimizer steps, in every chunk the LR schedule's horizon")
    chunk_steps: int = Field(gt=0, description="steps per chunk: one Ray job each (the last chunk may be shorter)")
    seed: int = critical(description="the run's seed: model init, data order, sampling")
    threads: int = critical(gt=0, description="torch/OMP threads: sums differ between thread counts")
    checkpoint_dir: str = critical(description="root folder; a run's checkpoints are in <checkpoint_dir>/<run>")
    data: DataSpec = Field(description="the training data")
    checkpoints: CheckpointPolicy = Field(
        default_factory=CheckpointPolicy, description="validation, retention and exports of checkpoints"
    )
    chunks: ChunkPolicy = Field(
        default_factory=ChunkPolicy, description="how a chunk hands over to the next: warm (the same job) or cold"
    )
    ray: RaySpec = Field(default_factory=RaySpec, description="the Ray cluster the chunks run on")
    elastic: ElasticSpec = Field(
        default_factory=ElasticSpec, description="a world size that follows the cluster (a range of nnodes)"
    )
    s3: S3Spec | None = Field(None, description="where validated checkpoints are published; none: nothing is published")
    alerts: AlertSpec = Field(default_factory=AlertSpec, description="who is told what, and when a job counts as stalled")
    airflow: AirflowSpec = Field(default_factory=AirflowSpec, description="the DAG: retries, schedule, pool, approvals")
    audit: AuditSpec = Field(default_factory=AuditSpec, description="the replay audit of steps trained twice")
    approvals: ApprovalSpec = Field(default_factory=ApprovalSpec, description="when a decision waits for a person in the UI")
    save_before: str | None = Field(
        default=None,
        description=(
            "a wall-clock deadline (a reservation's end): ISO 8601 with its zone or epoch seconds, or ${VAR} naming "
            "the job's environment variable that holds one. The trainer saves and ends its chunk early enough for "
            "the save to finish before it (relay.trainers.stopping)"
        ),
    )

    _source: str = PrivateAttr("<dict>")

    @field_validator("save_before")
    @classmethod
    def _a_time(cls, v: str | None) -> str | None:
        if v is not None and not project.variables(v):  # ${VAR} is read where the trainer runs
            try:
                deadline_seconds(v)
            except SpecError as e:
                raise ValueError(e.problem + "; " + (e.fix or "")) from None
        return v

    def deadline(self) -> float | None:
        """save_before as epoch seconds, ${VAR} read from this process's environment (None: no deadline)."""
        return deadline_seconds(self.save_before, self._source)

    @property
    def source(self) -> str:
        """The file the spec was loaded from (`<dict>` for one built in code)."""
        return self._source

    @property
    def warm_chunks(self) -> bool:
        """Whether a chunk that ends without a failure goes on in the same job (chunks.handoff; empty: where it can)."""
        if self.chunks.handoff is not None:
            return self.chunks.handoff == "warm"
        return warm_blocker(self) is None

    @property
    def dag_id(self) -> str:
        """The spec's DAG: relay_<name>."""
        return f"relay_{self.name}"

    @property
    def settings(self) -> Any:
        """The trainer's typed settings (the kind's own keys: for the kind's package)."""
        return self.trainer.typed_settings()

    @property
    def core_settings(self) -> CoreSettings:
        """What the core reads of the trainer's settings, whatever its kind."""
        return self.trainer.typed_settings().core()

    def run_dir(self, run_name: str) -> Path:
        """Where a training run's checkpoints live: verl's trainer.default_local_dir."""
        check_run_name(run_name)
        return Path(self.checkpoint_dir) / run_name

    def resume_critical(self) -> dict[str, Any]:
        """Resume-critical settings as {dotted.key: value}, the trainer's own marks included."""
        out = critical_values(self)
        out.pop("trainer.settings", None)
        out.update(critical_values(self.settings, "trainer.settings."))
        return out

    def settings_fingerprint(self) -> str:
        """A short digest of the resume-critical settings: equal fingerprints, the same experiment."""
        blob = json.dumps(self.resume_critical(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def to_json(self) -> str:
        """The resolved spec, as shipped to a Ray job (paths already absolute)."""
        return json.dumps({"source": self._source, "spec": self.model_dump(mode="json")})


def deadline_seconds(value: str | None, source: str = "<spec>", key: str = "save_before") -> float | None:
    """`save_before` (or `key`: alerts.deadline) as epoch seconds: an ISO 8601 time with its zone
    (2026-12-03T18:00:00Z), or epoch seconds; `${VAR}` (or `${VAR:-default}`) is read from this process's
    environment (the job's, on the cluster), and an empty value means no deadline."""
    if value is None:
        return None
    try:
        text = project.expand(str(value)).strip()
    except KeyError as e:
        raise SpecError(
            source,
            key,
            f"names the environment variable {e.args[0]}, which is not set here",
            f"set {e.args[0]} where it is read (the job's environment, ray.env_vars, for save_before; "
            f"Airflow's for alerts.deadline), or write ${{{e.args[0]}:-}} for no deadline when it is "
            "unset",
        ) from None
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise SpecError(
            source,
            key,
            f"{text!r} is not a time",
            "write an ISO 8601 time with its zone, e.g. 2026-12-03T18:00:00Z, or epoch seconds",
        ) from None
    if when.tzinfo is None:
        raise SpecError(
            source,
            key,
            f"{text!r} has no time zone",
            "add one (2026-12-03T18:00:00Z, or +02:00): a deadline must mean one instant everywhere",
        )
    return when.timestamp()


def check_run_name(run_name: str) -> str:
    """A training run's name, or a SpecError: it names a folder and an S3 prefix, so only safe characters."""
    # fullmatch: re.match's `$` also matches before a trailing newline ("run\n" would pass).
    if not isinstance(run_name, str) or not re.fullmatch(RUN_NAME_PATTERN, run_name) or ".." in run_name:
        raise SpecError(
            "run",
            "run",
            f"invalid run name {run_name!r}",
            "use letters, digits, '.', '_' or '-' (at most 128, starting with a letter or digit, no '..')",
        )
    return run_name


# ---------------------------------------------------------------------------------------- loading


def load_spec(path: str | os.PathLike[str], *, check_environment: bool = True) -> RunSpec:
    """Load and validate a spec file. With check_environment, also check data and checkpoint dir."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise SpecError(source, "", f"cannot read the file: {e.strerror}", "check the path") from None
    except UnicodeDecodeError as e:
        raise SpecError(source, "", f"not UTF-8 text (byte {e.start})", "save the spec as UTF-8 YAML") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(source, "", f"not valid YAML: {e}", "fix the YAML syntax at the position shown") from None
    except RecursionError:  # PyYAML recurses once per nesting level
        raise SpecError(source, "", "nested too deeply to be a run spec", "start from include/runs/demo.yaml") from None
    return spec_from_dict(raw, source=source, check_environment=check_environment)


def spec_for_dag(dag_id: str, runs_dir: Path | None = None) -> RunSpec | None:
    """The spec in runs_dir (default include/runs) whose DAG is `dag_id`; None for another DAG or a
    spec that does not load (its error shows as the relay_spec_errors DAG)."""
    for path in sorted((runs_dir or project.runs_dir()).glob("*.yaml")):
        try:
            spec = load_spec(path, check_environment=False)
        except SpecError:
            continue
        if spec.dag_id == dag_id:
            return spec
    return None


def spec_from_json(blob: str) -> RunSpec:
    """Inverse of RunSpec.to_json (on the cluster: no environment checks, paths are already resolved)."""
    try:
        data = json.loads(blob)
        raw, source = data["spec"], data["source"]
    except (ValueError, RecursionError, TypeError, KeyError) as e:
        raise SpecError(
            "<chunk request>",
            "",
            f"not a spec as RunSpec.to_json writes it ({type(e).__name__}: {str(e)[:120]})",
            "submit the chunk through Relay",
        ) from None
    return spec_from_dict(raw, source=str(source), check_environment=False, resolve=False)


def spec_from_dict(raw: Any, *, source: str = "<dict>", check_environment: bool = True, resolve: bool = True) -> RunSpec:
    """A RunSpec from a parsed mapping: validated (the kind's settings too), paths resolved, and with
    `check_environment` the files checked; a SpecError names the key and what to do."""
    if not isinstance(raw, dict):
        raise SpecError(
            source, "", f"must be a mapping of keys, got {type(raw).__name__}", "start from include/runs/demo.yaml"
        )
    spec = _validate(RunSpec, raw, source, "")
    settings_model = KINDS[spec.trainer.kind].settings_model()
    settings = _validate(settings_model, spec.trainer.settings, source, "trainer.settings.")
    updates: dict[str, Any] = {"trainer": spec.trainer.model_copy(update={"settings": settings.model_dump()})}
    if resolve:
        updates["checkpoint_dir"] = str(_resolve(source, "checkpoint_dir", spec.checkpoint_dir))
        updates["data"] = spec.data.model_copy(
            update=dict(
                train_files=[
                    str(_resolve(source, f"data.train_files[{i}]", f)) for i, f in enumerate(spec.data.train_files)
                ],
                val_files=[str(_resolve(source, f"data.val_files[{i}]", f)) for i, f in enumerate(spec.data.val_files)],
                expectations=[str(_resolve_expectations(source, i, f)) for i, f in enumerate(spec.data.expectations)],
            )
        )
    spec = spec.model_copy(update=updates)
    spec._source = source
    _check_templates(spec)
    _check_handoff(spec)
    _register_secrets(spec)
    if check_environment:
        check_spec_environment(spec)
    return spec


def warm_blocker(spec: RunSpec) -> str | None:
    """Why this run's chunks cannot hand over warm (None: they can): its trainer kind has no warm handoff, or the
    kind's own reason (verl's supervised mode, a save_freq that does not divide chunk_steps)."""
    kind = KINDS[spec.trainer.kind]
    if not kind.warm_handoff:
        return f"trainer kind {kind.name} has no warm handoff: each of its chunks starts a new job"
    return kind.warm_blocker_of(spec)


def _check_handoff(spec: RunSpec) -> None:
    """What only some runs can do: a warm handoff (asked for), saves off the critical path."""
    kind = KINDS[spec.trainer.kind]
    if spec.chunks.handoff == "warm" and (why := warm_blocker(spec)) is not None:
        raise SpecError(
            spec.source,
            "chunks.handoff",
            f"warm chunks cannot run here: {why}",
            "use chunks.handoff: cold, or leave it empty (warm where the run can be)",
        )
    if spec.core_settings.world_options and spec.checkpoints.on_world_size_change != "reshard":
        raise SpecError(
            spec.source,
            "checkpoints.on_world_size_change",
            "an elastic world size (a range of nodes or GPUs) changes the checkpoints' world size between chunks",
            "set checkpoints.on_world_size_change: reshard (each change is resharded, certified and alerted)",
        )
    if spec.core_settings.world_options and spec.core_settings.supervised:
        raise SpecError(
            spec.source,
            "trainer.settings.mode",
            "supervised mode trains the whole run in one job, whose world size cannot follow the cluster",
            "use mode: chunked with an elastic world size, or give nnodes and n_gpus_per_node as counts",
        )
    if spec.checkpoints.async_save and not kind.async_save:
        raise SpecError(
            spec.source,
            "checkpoints.async_save",
            f"trainer kind {kind.name} saves synchronously: it has no save off the critical path yet",
            f"leave checkpoints.async_save false for {kind.name}; kinds that save off the critical path: "
            + ", ".join(k.name for k in KINDS.values() if k.async_save),
        )


def _register_secrets(spec: RunSpec) -> None:
    """What ray.env_vars take from the environment (${VAR}) is secret: registered as soon as a process
    loads the spec, so that an error, a log line or an alert that carries it shows *** (relay.common.redaction)."""

    for value in spec.ray.env_vars.values():
        for name in project.variables(value):
            if name in os.environ:
                redaction.register(os.environ[name], name)


def _resolve_expectations(source: str, i: int, value: str) -> Path:
    """An expectations file: a path, or a bare name looked up in include/expectations/."""
    p = Path(value)
    if not p.suffix and len(p.parts) == 1:
        p = project.root() / "include" / "expectations" / f"{value}.yaml"
    return _resolve(source, f"data.expectations[{i}]", str(p))


def _resolve(source: str, key: str, value: str) -> Path:
    if any(ord(c) < 32 for c in value):
        raise SpecError(
            source, key, f"the path {value!r} holds a control character (a NUL, a newline...)", "write the path without it"
        )
    try:
        return project.resolve_path(value)
    except KeyError as e:
        raise SpecError(
            source,
            key,
            f"environment variable {e.args[0]} is not set",
            f"set {e.args[0]}, or give a default as ${{{e.args[0]}:-value}}",
        ) from None


_Model = TypeVar("_Model", bound=BaseModel)


def _validate(model: type[_Model], raw: Any, source: str, prefix: str) -> _Model:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        # A typo shows as an unknown key and a missing one: name the unknown key, with its suggestion.
        err = sorted(e.errors(), key=lambda x: x["type"] != "extra_forbidden")[0]
        key = _dotted(prefix, err["loc"])
        if err["type"] == "extra_forbidden":
            parent = _submodel(model, err["loc"][:-1])
            known = list(parent.model_fields) if parent else []
            near = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
            hint = f"did you mean '{near[0]}'? " if near else ""
            raise SpecError(source, key, "unknown key", f"{hint}known keys here: {', '.join(known)}") from None
        if err["type"] == "missing":
            raise SpecError(source, key, "required key is missing", "add it (see include/runs/demo.yaml)") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise SpecError(source, key, f"{msg} (got {_brief(err.get('input'))})") from None
    except RecursionError:
        raise SpecError(
            source, prefix.rstrip("."), "nested too deeply to be a run spec", "start from include/runs/demo.yaml"
        ) from None


def _brief(value: Any) -> str:
    """A short repr of a bad value for an error message (bounded in depth and length)."""

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxlist, r.maxdict = 3, 80, 80, 6, 6
    return r.repr(value)


def _dotted(prefix: str, loc: tuple[int | str, ...]) -> str:
    """('data', 'train_files', 0) -> data.train_files[0]"""
    key = prefix.rstrip(".")
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    return key


def _submodel(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            # Optional[Model] and similar: take the first BaseModel argument.
            ann = next((a for a in getattr(ann, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if ann is None:
            return None
        model = ann
    return model


# ---------------------------------------------------------------------------------- dated runs


def _data_paths(spec: RunSpec) -> Iterator[tuple[str, str]]:
    for field in ("train_files", "val_files"):
        for i, f in enumerate(getattr(spec.data, field)):
            yield f"data.{field}[{i}]", f


def _check_templates(spec: RunSpec) -> None:
    for key, f in _data_paths(spec):
        for name in TEMPLATE.findall(f):
            if name not in DATE_TEMPLATES:
                raise SpecError(
                    spec.source,
                    key,
                    f"unknown template {{{{ {name} }}}} in {f}",
                    f"a data path may name the DAG run's logical date as "
                    f"{' or '.join('{{ ' + k + ' }}' for k in DATE_TEMPLATES)}",
                )


def dated(spec: RunSpec, when: datetime) -> RunSpec:
    """The spec of the DAG run whose logical date is `when`: its data paths' dates filled in."""

    def fill(path: str) -> str:
        return TEMPLATE.sub(lambda m: when.strftime(DATE_TEMPLATES[m.group(1)]), path)

    data = spec.data.model_copy(
        update={"train_files": [fill(f) for f in spec.data.train_files], "val_files": [fill(f) for f in spec.data.val_files]}
    )
    out = spec.model_copy(update={"data": data})
    out._source = spec.source
    return out


def dated_run_name(spec: RunSpec, when: datetime) -> str:
    """A scheduled spec's training run for one logical date: <name>-YYYYMMDD (THHMM below a day)."""
    stamp = when.strftime("%Y%m%d") + ("" if (when.hour, when.minute) == (0, 0) else when.strftime("T%H%M"))
    return f"{spec.name}-{stamp}"


# ---------------------------------------------------------------------------------- environment


def is_templated(path: str) -> bool:
    """A data path filled in per DAG run (see dated): checked when that run starts."""
    return bool(TEMPLATE.search(path))


def check_spec_environment(spec: RunSpec) -> None:
    """Checks that need the filesystem: data files exist and can supply total_steps; checkpoint dir writable."""
    src = spec.source
    _check_writable(spec)
    if any(is_templated(f) for f in spec.data.train_files):
        return  # filled in per DAG run: checked by that run's preflight
    rows = sum(parquet_rows(src, f"data.train_files[{i}]", f) for i, f in enumerate(spec.data.train_files))
    for i, f in enumerate(spec.data.val_files):
        if not is_templated(f) and not Path(f).is_file():
            raise SpecError(src, f"data.val_files[{i}]", f"file not found: {f}", "fix the path")
    for i, f in enumerate(spec.data.expectations):
        if not Path(f).is_file():
            raise SpecError(
                src,
                f"data.expectations[{i}]",
                f"file not found: {f}",
                "put the file in include/expectations/ or fix the name",
            )
    settings = spec.trainer.typed_settings()
    available = settings.steps_available(rows)
    if available is not None and available < spec.total_steps:
        raise SpecError(
            src,
            "total_steps",
            f"the data cannot supply {spec.total_steps} steps: {rows} train rows give {available} steps "
            f"({settings.data_budget()})",
            "lower total_steps, raise trainer.settings.total_epochs, or add data",
        )


def parquet_rows(source: str, key: str, path: str) -> int:
    """The rows of a parquet file, or a SpecError naming the spec's key when it cannot be read."""
    if not Path(path).is_file():
        raise SpecError(source, key, f"file not found: {path}", "fix the path, or create the file")
    import pyarrow.parquet as pq  # lazy: only when a spec's environment is checked

    try:
        rows: int = pq.read_metadata(path).num_rows
        return rows
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a non-parquet file
        raise SpecError(source, key, f"not a readable parquet file: {path} ({e})", "check the file") from None


def _check_writable(spec: RunSpec) -> None:
    """Write a probe file into the checkpoint dir, or its nearest existing parent (os.access lies for root)."""
    d = Path(spec.checkpoint_dir)
    existing = d
    while not existing.exists():
        existing = existing.parent
    problem = None if existing.is_dir() else f"{existing} is not a folder"
    if problem is None:
        try:
            fd, probe = tempfile.mkstemp(prefix=".relay-probe-", dir=existing)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            problem = f"cannot write in {existing}: {e.strerror}"
    if problem:
        raise SpecError(
            spec.source,
            "checkpoint_dir",
            f"not writable: {d} ({problem})",
            "choose a folder this user can write, or fix its permissions",
        )
