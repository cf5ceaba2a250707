"""Trainer kinds: the registry a spec names its trainer from. Each kind names its settings model
(pydantic only) and its chunk function (heavy).

Both are import paths, resolved lazily, so validating a spec never imports torch, verl or ray.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel


@dataclass(frozen=True)
class TrainerKind:
    name: str
    settings: str  # "module:Class" of the settings model
    train_chunk: str  # "module:function" implementing the chunk contract (see contract.py)
    description: str
    smoke: str | None = None  # "module:function(spec, step_dir) -> str": a forward pass on a checkpoint
    # "module:function(spec, step_dir, certificate) -> str": the checkpoint's model compared offline with its
    # certificate (relay.checkpoints.certificate); raises CertificateError when it does not hold
    certify: str | None = None
    resolved: str | None = None  # "module:function(spec, train_rows) -> dict": settings the trainer derives
    job_env: str | None = None  # "module:function(req) -> dict[str, str]": extra environment of its Ray jobs
    warm_handoff: bool = False  # its chunk function goes on with the next chunk's steps (spec chunks.handoff: warm)
    warm_blocker: str | None = None  # "module:function(spec) -> str | None": why a spec of it cannot run warm
    async_save: bool = False  # it saves off the critical path (spec checkpoints.async_save)

    def settings_model(self) -> type[BaseModel]:
        model: type[BaseModel] = _load(self.settings)
        return model

    def chunk_function(self) -> Callable[..., Any]:
        function: Callable[..., Any] = _load(self.train_chunk)
        return function

    def smoke_function(self) -> Callable[..., str] | None:
        return _load(self.smoke) if self.smoke else None

    def certify_function(self) -> Callable[..., str] | None:
        return _load(self.certify) if self.certify else None

    def resolved_settings(self, spec: object, train_rows: int | None = None) -> dict[str, Any]:
        return _load(self.resolved)(spec, train_rows) if self.resolved else {}

    def warm_blocker_of(self, spec: object) -> str | None:
        return _load(self.warm_blocker)(spec) if self.warm_blocker else None

    def job_environment(self, req: object) -> dict[str, str]:
        return _load(self.job_env)(req) if self.job_env else {}


KINDS: dict[str, TrainerKind] = {
    "tiny_grpo": TrainerKind(
        name="tiny_grpo",
        settings="relay.trainers.tiny_grpo.settings:TinyGRPOSettings",
        train_chunk="relay.trainers.tiny_grpo.trainer:train_chunk",
        description="a small, real GRPO trainer on CPU built from verl's parts (demo and CI)",
        smoke="relay.trainers.tiny_grpo.trainer:smoke",
        certify="relay.trainers.tiny_grpo.trainer:certify",
        resolved="relay.trainers.tiny_grpo.trainer:resolved_settings",
        warm_handoff=True,
        async_save=True,
    ),
    "verl_ppo": TrainerKind(
        name="verl_ppo",
        settings="relay.trainers.verl_ppo.settings:VerlPPOSettings",
        train_chunk="relay.trainers.verl_ppo.trainer:train_chunk",
        description="verl's main_ppo (v1 sync, colocate_async or separate_async trainer) on a GPU Ray cluster, one "
        "chunk per job or one supervised job",
        resolved="relay.trainers.verl_ppo.trainer:resolved_settings",
        smoke="relay.trainers.verl_ppo.smoke:smoke",
        certify="relay.trainers.verl_ppo.smoke:certify",
        job_env="relay.trainers.verl_ppo.trainer:job_env",
        warm_handoff=True,
        warm_blocker="relay.trainers.verl_ppo.settings:warm_blocker",
        async_save=True,
    ),
}


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
