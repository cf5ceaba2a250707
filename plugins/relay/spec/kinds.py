"""Trainer kinds: what a spec's `trainer.kind` names, and the one registry of them.

A kind declares what it can do (its capabilities: runs as a Ray job, warm handoff, saves off the critical path,
certificates, reshard, its modes) and where its parts are, as "module:attr" import paths resolved lazily, so that
validating a spec never imports torch, verl or ray. The core asks a kind what it can do; it never asks which kind
it is.

The registry: Relay's own kinds (BUILT_IN, each declared in its own package's `kind` module), then every kind a
team registers in the entry point group `relay.trainers` of its own distribution, without editing Relay:

    [project.entry-points."relay.trainers"]
    my_trainer = "my_package.kind:KIND"      # a TrainerKind named my_trainer

Relay's own are listed here, not only as entry points, because a Ray job imports Relay from its runtime_env's
py_modules, where no distribution's metadata is installed; a team's kind must be installed in the cluster's image.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, ClassVar

from relay.spec.model import StrictModel

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "relay.trainers"
BUILT_IN = {
    "tiny_grpo": "relay.trainers.tiny_grpo.kind:KIND",
    "verl_ppo": "relay.trainers.verl_ppo.kind:KIND",
}


@dataclass(frozen=True)
class WorldOption:
    """A world size an elastic spec may train at, and what it needs of the cluster: its placement groups, each
    (CPUs, GPUs) that one node must hold (verl packs each node's workers onto one node)."""

    world_size: int
    nnodes: int
    gpus_per_node: int
    groups: tuple[tuple[float, float], ...]

    def describe(self) -> str:
        """The option in a log's words."""
        return f"world size {self.world_size} ({self.nnodes} node(s) x {self.gpus_per_node} GPU(s))"


@dataclass(frozen=True)
class CoreSettings:
    """What the core reads of a trainer's settings, whatever the kind (TrainerSettings.core)."""

    save_freq: int = 0  # the trainer also saves every N steps inside a chunk (0: only at the chunk's end)
    world_size: int | None = None  # the processes its checkpoints are sharded over (None: it does not say)
    fsdp_version: int | None = None  # the FSDP layout its checkpoints are written in
    world_size_divisor: int = 1  # a world size must divide by it (verl: the rollout's tensor parallel size)
    supervised: bool = False  # one long job for the whole run; the chunk tasks only wait for its checkpoints
    prompts_in_flight: bool = False  # a checkpoint holds prompts still in flight (verl's async modes: the ledger)
    logical_gpus: int = 0  # the GPUs a private Ray head must offer its job on a CPU host (0: none)
    cpu_platform: bool = True  # it runs on Relay's CPU stand-ins, not a GPU cluster
    batch_rows: int = 1  # the training rows one step reads: a training file needs at least that many
    critic: bool = False  # its checkpoints hold a critic/ beside actor/
    # elastic: the world sizes it may train at, the largest first (empty: only world_size); each chunk's cold start
    # takes the largest the cluster holds (relay.ops.elastic)
    world_options: tuple[WorldOption, ...] = ()


class TrainerSettings(StrictModel):
    """The base of every kind's settings model: the kind's own keys, and `core()`, what the core reads of them."""

    # its keys that only say how many processes train: with checkpoints.on_world_size_change: reshard, a change
    # of them reshards the checkpoint instead of being refused as drift
    WORLD_SIZE_KEYS: ClassVar[tuple[str, ...]] = ()

    def core(self) -> CoreSettings:
        """What the core reads of these settings; a kind overrides it with what applies to it."""
        return CoreSettings()

    def steps_available(self, train_rows: int) -> int | None:
        """The training steps `train_rows` rows can supply (None: the kind sets no such limit)."""
        return None

    def data_budget(self) -> str:
        """The keys steps_available reads, with their values, for its error message."""
        return ""


@dataclass(frozen=True)
class TrainerKind:
    """A trainer kind: its name, its settings model and chunk function (the contract, relay.trainers.contract),
    what it can do, and its optional parts, each a "module:attr" import path."""

    name: str
    settings: str  # "module:Class" of the settings model (a TrainerSettings)
    train_chunk: str  # "module:function(ChunkRequest) -> ChunkResult" implementing the chunk contract
    description: str
    # capabilities
    ray_job: bool = False  # its chunks run as Ray jobs (`relay train` runs them on a Ray cluster); else in-process
    warm_handoff: bool = False  # its chunk function goes on with the next chunk's steps (spec chunks.handoff: warm)
    async_save: bool = False  # it saves off the critical path (spec checkpoints.async_save)
    reshard: bool = False  # its checkpoints are resharded to another world size (relay.checkpoints.reshard)
    modes: tuple[str, ...] = ("chunked",)  # chunked: one job per chunk; supervised: one job for the run
    # parts
    smoke: str | None = None  # "module:function(spec, step_dir) -> str": a forward pass on a checkpoint
    # "module:function(spec, step_dir, certificate) -> str": the checkpoint's model compared offline with its
    # certificate (relay.checkpoints.certificate); raises CertificateError when it does not hold
    certify: str | None = None
    resolved: str | None = None  # "module:function(spec, train_rows) -> dict": settings the trainer derives
    job_env: str | None = None  # "module:function(req) -> dict[str, str]": extra environment of its Ray jobs
    warm_blocker: str | None = None  # "module:function(spec) -> str | None": why a spec of it cannot run warm
    # "module:function(spec) -> object with ok, detail, fix | None": a check of the spec against what this host
    # and the cluster's image provide (`relay spec check`, `relay doctor`); a warning, never a failure
    environment_check: str | None = None
    # a module `python -m MODULE --json [--cpu]` runs on the cluster to check the library the kind trains with
    # (doctor); its `report(cpu) -> dict` runs it here (--offline)
    library_contract: str | None = None
    whole_run: str | None = None  # "module:function(spec) -> spec": the spec as its supervised job sees it
    tiny_model: str | None = None  # "module:function(folder) -> Path": a tiny model it trains on a CPU, no download

    @property
    def certificates(self) -> bool:
        """Whether its checkpoints carry a certificate that is checked offline (`certify`)."""
        return self.certify is not None

    def settings_model(self) -> type[TrainerSettings]:
        """Its settings model (a TrainerSettings subclass)."""
        model = _load(self.settings)
        if not (isinstance(model, type) and issubclass(model, TrainerSettings)):
            raise TypeError(
                f"trainer kind {self.name!r}: settings {self.settings!r} is not a relay.spec.kinds.TrainerSettings; "
                "derive the kind's settings model from it"
            )
        return model

    def chunk_function(self) -> Callable[..., Any]:
        """Its chunk function (imports the trainer)."""
        function: Callable[..., Any] = _load(self.train_chunk)
        return function

    def smoke_function(self) -> Callable[..., str] | None:
        """Its forward pass on a checkpoint, if it has one."""
        return _load(self.smoke) if self.smoke else None

    def certify_function(self) -> Callable[..., str] | None:
        """Its offline certificate check, if it has one."""
        return _load(self.certify) if self.certify else None

    def resolved_settings(self, spec: object, train_rows: int | None = None) -> dict[str, Any]:
        """The settings it derives from the spec and the data (recorded with the run's settings)."""
        return _load(self.resolved)(spec, train_rows) if self.resolved else {}

    def warm_blocker_of(self, spec: object) -> str | None:
        """Why a spec of it cannot go on warm into the next chunk, or None."""
        return _load(self.warm_blocker)(spec) if self.warm_blocker else None

    def job_environment(self, req: object) -> dict[str, str]:
        """The extra environment of its Ray jobs."""
        return _load(self.job_env)(req) if self.job_env else {}

    def check_environment(self, spec: object) -> Any:
        """Its check of the spec against this host and the cluster's image, or None without one."""
        return _load(self.environment_check)(spec) if self.environment_check else None

    def library_contract_module(self) -> Any:
        """The module of its library contract (`report(cpu)`, `MARK`, `LIBRARY`, runnable with `-m`), or None."""
        return importlib.import_module(self.library_contract) if self.library_contract else None

    def make_tiny_model(self, folder: Any) -> Any:
        """Write its tiny CPU model into `folder` (`relay model tiny`); the folder written."""
        if not self.tiny_model:
            raise ValueError(f"trainer kind {self.name!r} has no tiny model")
        return _load(self.tiny_model)(folder)

    def whole_run_view(self, spec: Any) -> Any:
        """The spec as its supervised job sees it (one chunk of every step); the spec itself without one."""
        return _load(self.whole_run)(spec) if self.whole_run else spec


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


BROKEN: dict[str, str] = {}  # kinds registered through an entry point that did not load: name -> why


def _registered() -> dict[str, TrainerKind]:
    kinds = {name: _load(path) for name, path in BUILT_IN.items()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in kinds and ep.value == BUILT_IN.get(ep.name):
            continue
        where = f"entry point {ep.name} = {ep.value!r} of {ep.dist.name if ep.dist else 'an unknown distribution'}"
        try:
            kind = ep.load()
        except Exception as e:  # noqa: BLE001 - a team's broken package must not take Relay down: said when named
            BROKEN[ep.name] = f"{where} did not load: {type(e).__name__}: {e}"
        else:
            if not isinstance(kind, TrainerKind) or kind.name != ep.name:
                BROKEN[ep.name] = f"{where} is not a relay.spec.kinds.TrainerKind named {ep.name!r}"
            elif ep.name in kinds:
                BROKEN[ep.name] = f"{where} names a kind Relay already has; register it under another name"
            else:
                kinds[ep.name] = kind
                continue
        log.warning("trainer kind %s left out: %s", ep.name, BROKEN[ep.name])
    return kinds


KINDS: dict[str, TrainerKind] = _registered()


def unknown_kind(name: str) -> str:
    """Why `name` is no kind, and which are."""
    if name in BROKEN:
        return f"trainer kind {name!r} is registered, but {BROKEN[name]}; fix or reinstall that package"
    return (
        f"unknown trainer kind {name!r}; known kinds: {', '.join(KINDS)} (a team's own kind registers in the "
        f"entry point group {ENTRY_POINT_GROUP!r})"
    )
