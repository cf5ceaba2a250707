"""What Relay relies on in verl's (and torch's, and Ray's) own code that is not documented as public, and the check
that it is still there.

Relay copies no verl code: it subclasses verl's trainer, registers its parts where verl looks them up, and calls
into verl's workers. Where verl offers a public way, Relay uses it (`trainer.checkpoint_callback_class` after each
save, `CheckpointEngineRegistry.register` and `EngineRegistry.register`, the custom-sampler config, the platform
registry). Everything else is a TOUCH_POINT below: the symbol, why Relay needs it, the verl version it was read in,
and the shape Relay relies on (a callable's parameters, a mapping's keys, text its source holds: a tag's value, an
attribute it assigns). `problems()` checks them all in the verl this process imports; the job's driver refuses to
train when one fails (naming the symbol and the installed version), and `relay doctor` runs the same checks on the
cluster (`python -m relay.trainers.verl_ppo.verl_contract --json`, as a Ray job). Entries marked `cpu_only` matter
only on the CPU platform (relay.trainers.verl_ppo.cpu).

A leaf module: it imports verl only inside its checks, so that the horizon check, the task runner, the driver and
the chunk trainer can all use it without importing each other.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from relay.common.errors import RelayError

# verl's CPU path (relay.trainers.verl_ppo.cpu.platform): the environment a job sets so that every verl
# process picks the `cpu` platform (verl/plugin/platform/platform_manager.py reads VERL_PLATFORM) and
# imports the module that registers it (verl/__init__.py imports VERL_USE_EXTERNAL_MODULES). Kept here,
# in a light module, so that whoever builds a job's environment does not import verl.
CPU_PLATFORM = "cpu"
HF_ROLLOUT = "hf"  # the rollout that generates with transformers in verl's hybrid worker (cpu/hf_rollout.py)
HF_AGENT_LOOP = "relay_single_turn_agent"  # its agent loop: verl's single-turn one, requests tagged by sample
CPU_PLATFORM_ENV = {"VERL_PLATFORM": CPU_PLATFORM, "VERL_USE_EXTERNAL_MODULES": "relay.trainers.verl_ppo.cpu.platform"}
PINNED = "0.9.1"  # the verl version these touch points were read in (pyproject pins verl>=0.9.1,<0.10)


class VerlContractError(RelayError):
    """verl changed under Relay: a touch point Relay relies on is gone or changed shape."""

    exit_code = 2
    retry_helps = False


def original_class(actor_class) -> type:
    """The plain class under a @ray.remote actor class (Ray keeps it as __ray_actor_class__)."""
    modified = actor_class.__ray_metadata__.modified_class
    cls = getattr(modified, "__ray_actor_class__", None)
    if not isinstance(cls, type) or not callable(getattr(cls, "run", None)):
        raise TypeError(f"{actor_class!r} does not wrap a class with run()")
    return cls


@dataclass(frozen=True)
class TouchPoint:
    """One symbol of verl (or torch, or Ray) that Relay relies on without a public promise.

    symbol: "module:qualified.name"; why: what of Relay needs it; since: the version of its package it was read in;
    cpu_only: needed on the CPU platform only; params: a callable's leading parameters (after self); keys: what a
    mapping holds; source: text its source holds (a tag's value, an attribute it assigns, a call it makes);
    shape: any other check of the object, returning what is wrong (None: nothing)."""

    symbol: str
    why: str
    since: str = PINNED
    cpu_only: bool = False
    params: tuple[str, ...] = ()
    keys: tuple[Any, ...] = ()
    source: tuple[str, ...] = ()
    shape: Callable[[Any], str | None] | None = None

    @property
    def package(self) -> str:
        return self.symbol.partition(".")[0].partition(":")[0]


def _trainer(name: str, why: str, params: tuple[str, ...] = (), source: tuple[str, ...] = ()) -> TouchPoint:
    return TouchPoint(f"verl.trainer.ppo.v1.trainer_base:PPOTrainer.{name}", why, params=params, source=source)


def _task_runner_shape(task_runner: Any) -> str | None:
    """a Ray actor class over a plain class whose run(config) looks the trainer up by trainer_mode"""
    from pathlib import Path

    try:
        runner = original_class(task_runner)
        text = Path(inspect.getfile(runner)).read_text()  # the file's text: inspect may lose a class Ray pickled
    except (AttributeError, TypeError, OSError) as e:
        return f"cannot be subclassed as Relay does ({e})"
    body = text[text.find(f"class {runner.__name__}") :]
    body = body[: body.find("\n@hydra.main")] if "\n@hydra.main" in body else body
    if "get_trainer_cls(config.trainer.v1.trainer_mode)" not in body or "def run(self, config" not in body:
        return "its run() no longer looks the trainer up with get_trainer_cls(config.trainer.v1.trainer_mode)"
    return None


def _setup_order(setup: Any) -> str | None:
    """the dataloader built before the worker groups"""
    text = inspect.getsource(setup)
    first_dl, first_wg = text.find("self._init_dataloader()"), text.find("RayWorkerGroup(")
    if first_dl < 0 or first_wg < 0 or first_dl > first_wg:
        return "no longer builds the dataloader before the worker groups (whose LR schedulers read the horizon)"
    return None


def _dataclass_fields(*names: str) -> Callable[[Any], str | None]:
    def shape(cls: Any) -> str | None:
        missing = [n for n in names if n not in getattr(cls, "__dataclass_fields__", {})]
        return f"has no field {', '.join(missing)}" if missing else None

    shape.__doc__ = "dataclass fields " + ", ".join(f"`{n}`" for n in names)
    return shape


def _callable(obj: Any) -> str | None:
    """callable"""
    return None if callable(obj) else "is not callable"


def _a_dict(obj: Any) -> str | None:
    """a dict"""
    return None if isinstance(obj, dict) else "is not a dict"


def _callable_or_none(obj: Any) -> str | None:
    """callable (None where torch has no FSDP2)"""
    return None if obj is None or callable(obj) else "is not callable"


def _storage_identity(untyped_storage: Any) -> str | None:
    """`_cdata`: one int per storage, the same for its views"""
    import torch

    a = torch.zeros(4)
    if (
        not isinstance(getattr(a.untyped_storage(), "_cdata", None), int)
        or a.untyped_storage()._cdata != a[1:].untyped_storage()._cdata
    ):
        return "_cdata no longer tells storages apart (one int per storage, the same for its views)"
    return None


def _dtensor_fields(dtensor: Any) -> str | None:
    """`_local_tensor` and `_spec` set in `__new__`

    (read in its module's file: a decorator hides __new__'s source from inspect)."""
    from pathlib import Path

    text = Path(inspect.getfile(importlib.import_module("torch.distributed.tensor._api"))).read_text()
    if not isinstance(dtensor, type) or "r._spec = spec" not in text or "r._local_tensor = local_tensor" not in text:
        return "no longer keeps its shard and spec as _local_tensor and _spec"
    return None


# The horizon's facts (relay.trainers.verl_ppo.horizon): without them a chunk ends through total_training_steps.
LOOP_BOUND_FACTS = ("PPOTrainer._init_dataloader", "PPOTrainer.fit", "PPOTrainer._setup")

TOUCH_POINTS: tuple[TouchPoint, ...] = (
    # ---- the chunk trainer in verl's place (chunk_trainer.install, runner.RelayTaskRunner)
    TouchPoint(
        "verl.trainer.ppo.v1.trainer_base:TRAINER_REGISTRY",
        "install() swaps Relay's chunk trainer in under verl's trainer_mode (register_trainer refuses a second class "
        "under a name, and the mode must stay verl's: verl tests trainer_mode != 'sync')",
        keys=("sync", "colocate_async", "separate_async"),
    ),
    TouchPoint(
        "verl.trainer.main_ppo:TaskRunnerV1",
        "RelayTaskRunner subclasses the class under Ray's actor wrapper (Ray's private __ray_metadata__) so that the "
        "trainer is installed inside the actor, where verl looks it up",
        shape=_task_runner_shape,
    ),
    # ---- verl's PPOTrainer methods the chunk trainer overrides or relies on (chunk_trainer.RelayChunk)
    _trainer(
        "_init_dataloader",
        "the loop bound is lowered after verl wrote the LR horizon from the run's total (horizon.LOOP_BOUND_FACTS)",
        params=(),
        source=(
            "self.total_training_steps = total_training_steps",
            "actor_rollout_ref.actor.optim.total_training_steps = optim_total_training_steps",
        ),
    ),
    _trainer(
        "fit",
        "verl's loop runs while global_steps <= total_training_steps and saves the step that reaches it",
        source=(
            "self.global_steps <= self.total_training_steps",
            "is_last_step = self.global_steps >= self.total_training_steps",
        ),
    ),
    TouchPoint(
        "verl.trainer.ppo.v1.trainer_base:PPOTrainer._setup",
        "the workers (and their LR schedulers) are built after _init_dataloader wrote the horizon",
        shape=_setup_order,
    ),
    _trainer(
        "_load_checkpoint",
        "the step verl resumes from is checked against the one Relay validated, then certified",
        params=(),
        source=("find_latest_ckpt_path(checkpoint_folder)", "self.global_steps = int("),
    ),
    _trainer(
        "_save_checkpoint",
        "verl's own save runs into Relay's staging folder (trainer.default_local_dir, read at each save), wrapped by "
        "the async save and followed by the fenced commit; verl's checkpoint callback names the folder it wrote",
        params=(),
        source=("self.config.trainer.default_local_dir", "self.checkpoint_callback.on_save("),
    ),
    _trainer("_validate", "validation at a chunk's end (not the run's) is skipped unless the spec asks"),
    _trainer(
        "_balance_batch",
        "the step's responses are put in one order before verl balances them (a resume equals a run)",
        params=("batch", "metrics"),
    ),
    _trainer(
        "_next_train_batch", "the dataset indices of each step's prompts, for its metrics row", params=("num_prompts",)
    ),
    _trainer(
        "_compute_metrics",
        "one metrics row per step, the lease checked",
        params=("batch", "metrics", "timing_raw", "global_steps", "epoch"),
    ),
    _trainer(
        "_init_resource_pool_mgr",
        "verl's resource pools are checked against the cluster's nodes before verl waits on them without a timeout",
        params=(),
    ),
    TouchPoint(
        "verl.single_controller.ray.base:ResourcePoolManager",
        "placement reads resource_pool_spec; on the CPU platform max_colocate_count is set to 1",
        shape=_dataclass_fields("resource_pool_spec", "max_colocate_count"),
    ),
    *(
        _trainer(hook, "graceful stops, warm handoffs, phase marks and the async rule's drains hook verl's loop here")
        for hook in ("on_init_end", "on_train_begin", "on_train_end", "on_step_begin", "on_step_end")
    ),
    # ---- the async modes (async_trainer)
    _trainer(
        "_submit_batch_to_rollout",
        "every prompt handed out is numbered; its queue tags (is_prompt, status pending) tell the drain what is in flight",
        params=("batch",),
        source=('"is_prompt": True, "status": "pending"',),
    ),
    TouchPoint(
        "verl.trainer.ppo.v1.agent_loop_tq:AgentLoopWorkerTQ._run_prompt",
        "a prompt being generated is tagged status running: the drain waits for it",
        source=('tag={"status": "running"}',),
    ),
    _trainer("step", "what each step trained (its samples' uids and policy versions)", params=("metrics", "timing_raw")),
    *(
        _trainer(hook, "bitwise drains the prompts in flight before a step samples", params=())
        for hook in ("on_sample_begin", "on_sample_end")
    ),
    TouchPoint(
        "verl.trainer.ppo.v1.replay_buffer:ReplayBufferAsync._select_prompt_uids",
        "FirstInFirstOut chooses the oldest prompts handed out, returning verl's partitions and prompt_global_steps",
        params=("partition_id", "sampleable_keys", "batch_size"),
    ),
    TouchPoint(
        "verl.trainer.ppo.v1.replay_buffer:ReplayBufferAsync.__init__",
        "FirstInFirstOut returns the buffer's own partitions and prompt_global_steps",
        source=("self.partitions", "self.prompt_global_steps"),
    ),
    TouchPoint(
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._evict_terminal_groups",
        "every eviction verl makes is recorded in the prompt ledger with its reason (stale, filtered, failed uids)",
        params=("global_steps", "partition_id", "eviction_reasons"),
        source=("stale_uids, dapo_uids, failed_uids, dapo_counts = eviction_reasons", "return evicted_uids, "),
    ),
    _trainer(
        "_reissue_inflight_prompts",
        "lossless: a resume lets verl re-issue the prompts that were generating, stamped with the resume's step; "
        "Relay checks it re-issued exactly the ledger's",
        params=("partition_id",),
        source=('tag.get("status") in ("pending", "running")', '"global_steps": self.global_steps'),
    ),
    TouchPoint(
        "verl.checkpoint_engine.base:CheckpointEngineManager.abort_replicas",
        "lossless: separate_async's rollout paused while verl saves its queue (resumed by resume_generation_replicas)",
    ),
    TouchPoint(
        "verl.checkpoint_engine.base:CheckpointEngineManager.resume_generation_replicas",
        "lossless: separate_async's rollout resumed after verl saved its queue",
    ),
    TouchPoint(
        "verl.workers.rollout.llm_server:FullyAsyncLLMServerClient.generate",
        "the hf stand-in's abort answers stop_reason aborted with the tokens so far; verl's client asks again with them",
        source=('output.stop_reason not in ("aborted", "abort")', "prompt_ids=prompt_ids + final_output.token_ids"),
    ),
    # ---- inside verl's workers (Ray's __ray_call__: certify, worker_saves, async_save)
    TouchPoint(
        "verl.workers.engine_workers:ActorRolloutRefWorker",
        "the certificate and the async save reach the actor's engine as worker.actor.engine",
        source=("self.actor = ",),
    ),
    TouchPoint(
        "verl.workers.engine_workers:TrainingWorker.__init__",
        "the certificate reaches a critic's engine as worker.engine",
        source=("self.engine: BaseEngine = ",),
    ),
    TouchPoint(
        "verl.workers.engine.fsdp.transformer_impl:FSDPEngine",
        "the certificate digests engine.module, engine.optimizer and engine.lr_scheduler; the async save allocates "
        "for engine.checkpoint_manager",
        source=(
            "self.module = module",
            "self.optimizer = optimizer",
            "self.lr_scheduler = lr_scheduler",
            "self.checkpoint_manager = FSDPCheckpointManager(",
        ),
    ),
    TouchPoint(
        "verl.utils.checkpoint.fsdp_checkpoint_manager:FSDPCheckpointManager.save_checkpoint",
        "the async save defers the torch.save calls of this module while this method runs; the files it writes by name",
        params=("local_path", "hdfs_path", "global_step", "max_ckpt_to_keep"),
        source=("torch.save(model_state_dict, model_path)", "torch.save(optimizer_state_dict, optim_path)"),
    ),
    TouchPoint(
        "verl.utils.fsdp_utils:get_fsdp_state_ctx",
        "the async save allocates its host buffers for the sharded state dicts verl's save asks for",
        params=("model", "state_type", "state_cfg", "optim_cfg"),
    ),
    TouchPoint(
        "verl.utils.checkpoint.checkpoint_manager:BaseCheckpointManager.get_rng_state",
        "the certificate digests the RNG state verl saves with each checkpoint",
        shape=_callable,
    ),
    TouchPoint(
        "verl.utils.checkpoint.checkpoint_manager:find_latest_ckpt_path",
        "hygiene checks that verl's tracker names the step Relay resumes from",
        params=("path",),
    ),
    # ---- torch's private parts (async_save, certificate)
    TouchPoint(
        "torch.distributed.tensor:DTensor",
        "the async save remakes a DTensor over its copy from _local_tensor and _spec (its cached hash is pickled)",
        since="2.13.0",
        shape=_dtensor_fields,
    ),
    TouchPoint(
        "torch:UntypedStorage",
        "the async save tells storages apart by _cdata, as torch.save does (tied weights stay shared)",
        since="2.13.0",
        shape=_storage_identity,
    ),
    TouchPoint(
        "torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
        "the certificate places each FSDP2 shard at its global offset",
        since="2.13.0",
        params=("global_shape", "mesh", "placements"),
    ),
    TouchPoint(
        "torch.distributed.fsdp._flat_param:FlatParamHandle._init_shard_metadata",
        "the certificate reads FSDP1's flat parameters through their _fqns and _shard_param_infos",
        since="2.13.0",
        source=("_shard_param_infos",),
    ),
    TouchPoint(
        "torch._utils:_rebuild_tensor_v2",
        "the restricted unpickler of verl's TransferQueue pickles rebuilds tensors through it",
        since="2.13.0",
        params=("storage", "storage_offset", "size", "stride", "requires_grad", "backward_hooks"),
    ),
    TouchPoint(
        "torch.storage:_load_from_bytes",
        "the restricted unpickler reads a queue tensor's storage bytes as torch pickled them",
        since="2.13.0",
        params=("b",),
    ),
    # ---- the CPU platform only (relay.trainers.verl_ppo.cpu)
    TouchPoint(
        "verl.workers.rollout.base:_ROLLOUT_REGISTRY",
        "the hf rollout's adapter is named here (verl has no register function for it)",
        cpu_only=True,
        keys=(("vllm", "async"),),
    ),
    TouchPoint(
        "verl.experimental.agent_loop.agent_loop:_agent_loop_registry",
        "the hf rollout's agent loop is named by its Hydra target without importing it at `import verl` (verl's "
        "register() needs the class; its agent_loop_config_path needs a file path every node resolves)",
        cpu_only=True,
        shape=_a_dict,
    ),
    TouchPoint(
        "verl.utils.distributed:initialize_global_process_group_ray",
        "patch 1: its default backend names the cpu device twice on the CPU platform",
        cpu_only=True,
        params=("timeout_second", "backend"),
    ),
    TouchPoint(
        "verl.workers.engine.fsdp.transformer_impl:FSDPEngine._build_fsdp_module",
        "patch 2: the reference model's pinned CPUOffloadPolicy and FSDP1's CPUOffload, imported at each build",
        cpu_only=True,
        source=("CPUOffloadPolicy(pin_memory=True)", "CPUOffload(offload_params=True)"),
    ),
    TouchPoint(
        "verl.workers.engine.fsdp.transformer_impl:CPUOffloadPolicy",
        "patch 2: replaced by an unpinned policy of torch's own class",
        cpu_only=True,
        shape=_callable_or_none,
    ),
    TouchPoint(
        "torch.distributed.fsdp._init_utils:_check_module_states_for_sync_module_states",
        "patch 3: lifted so that FSDP1 broadcasts rank 0's CPU weights over gloo",
        since="2.13.0",
        cpu_only=True,
        params=("module_states",),
    ),
    TouchPoint(
        "verl.utils.fsdp_utils:load_fsdp_model_to_gpu",
        "patch 4: an FSDP1 model is not moved to 'cpu:cpu'",
        cpu_only=True,
        params=("model",),
    ),
    TouchPoint(
        "torch.distributed.fsdp._runtime_utils:_lazy_init",
        "patch 4: the FSDP1 root lazily initialised, as verl's function does first",
        since="2.13.0",
        cpu_only=True,
        params=("state", "root_module"),
    ),
    TouchPoint(
        "verl.utils.model:load_valuehead_model",
        "patch 5: the critic's value model loads with flash-attn whatever the spec says",
        cpu_only=True,
        params=("local_path", "torch_dtype", "model_config", "trust_remote_code"),
    ),
    TouchPoint(
        "verl.workers.rollout.replica:RolloutReplica",
        "HFReplica.launch_servers sets the replica's _server_handle and _server_address as verl's replicas do",
        cpu_only=True,
        source=("self._server_handle", "self._server_address", "self.replica_rank", "self.workers"),
    ),
)


def owner_of(symbol: str) -> tuple[Any, str]:
    """The object that holds the symbol's last name, and that name (a Ray actor class read as the class under it)."""
    module, _, qualname = symbol.partition(":")
    *parents, name = qualname.split(".")
    owner: Any = importlib.import_module(module)
    for part in parents:
        owner = getattr(owner, part)
        if hasattr(owner, "__ray_metadata__"):  # @ray.remote: the methods are the plain class's
            owner = owner.__ray_metadata__.modified_class.__ray_actor_class__
    return owner, name


def _resolve(symbol: str) -> Any:
    owner, name = owner_of(symbol)
    return getattr(owner, name)


def _installed(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def _shape_problem(point: TouchPoint, obj: Any) -> str | None:
    if point.params:
        try:
            names = [n for n in inspect.signature(obj).parameters if n != "self"]
        except (TypeError, ValueError):
            return "has no signature"
        if names[: len(point.params)] != list(point.params):
            return f"takes ({', '.join(names)}), Relay relies on ({', '.join(point.params)})"
    if point.keys:
        if not isinstance(obj, Mapping):
            return f"is a {type(obj).__name__}, not a mapping"
        if missing := [k for k in point.keys if k not in obj]:
            return f"no longer holds {', '.join(map(repr, missing))}"
    if point.source:
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError):
            return "has no source to read"
        if missing := [s for s in point.source if s not in text]:
            return "no longer has " + "; ".join(f"`{s}`" for s in missing)
    return point.shape(obj) if point.shape is not None else None


def check(point: TouchPoint) -> str | None:
    """What is wrong with one touch point in the installed packages, naming the symbol and the versions (None: it
    holds)."""
    what: str | None
    try:
        obj = _resolve(point.symbol)
    except (ImportError, AttributeError) as e:
        what = f"is gone ({type(e).__name__}: {e})"
    else:
        try:
            what = _shape_problem(point, obj)
        except Exception as e:  # noqa: BLE001 - a check that cannot run is a changed shape too
            what = f"cannot be checked ({type(e).__name__}: {e})"
        if what is None:
            return None
    return (
        f"{point.symbol} {what} in {point.package} {_installed(point.package)}; Relay relies on it since "
        f"{point.package} {point.since}: {point.why}"
    )


def selected(*, cpu: bool = True, names: Iterable[str] | None = None) -> list[TouchPoint]:
    """The touch points a job needs (`cpu`: the CPU platform's too), or those whose symbols end with `names`."""
    wanted = tuple(names) if names is not None else None
    return [
        p for p in TOUCH_POINTS if (cpu or not p.cpu_only) and (wanted is None or any(p.symbol.endswith(n) for n in wanted))
    ]


def problems(*, cpu: bool = True, names: Iterable[str] | None = None) -> list[str]:
    """Every touch point that does not hold here (see check)."""
    return [why for p in selected(cpu=cpu, names=names) if (why := check(p)) is not None]


def required(*, cpu: bool) -> list[TouchPoint]:
    """The touch points without which no chunk trains (the loop-bound facts have horizon's fallback instead)."""
    return [p for p in selected(cpu=cpu) if not p.symbol.endswith(LOOP_BOUND_FACTS)]


def require(*, cpu: bool) -> int:
    """Raise VerlContractError naming every required touch point that does not hold; else the number checked."""
    points = required(cpu=cpu)
    if found := [why for p in points if (why := check(p)) is not None]:
        raise VerlContractError(
            f"verl {_installed('verl')} is not the verl Relay was built against: " + " | ".join(found),
            f"install verl {PINNED} in the cluster image (pyproject pins verl>={PINNED},<0.10), or run "
            "`relay doctor SPEC` to see every difference",
        )
    return len(points)


def report(*, cpu: bool) -> dict[str, Any]:
    """The checks' outcome as JSON-able data: what `relay doctor` reads back from the cluster."""
    verl = _installed("verl")
    return {
        "library": LIBRARY,
        "version": verl,
        "fix": f"install verl {PINNED} in the cluster image (Relay's contract), or run a Relay that supports verl {verl}",
        "verl": verl,
        "torch": _installed("torch"),
        "checked": len(selected(cpu=cpu)),
        "problems": [why for p in required(cpu=cpu) if (why := check(p)) is not None],
        "loop_bound": problems(names=LOOP_BOUND_FACTS),
    }


MARK = "RELAY_VERL_CONTRACT "  # the line of a job's log that holds the report
LIBRARY = "verl"  # what relay doctor names the check after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay.trainers.verl_ppo.verl_contract")
    parser.add_argument("--cpu", action="store_true", help="also the CPU platform's touch points")
    parser.add_argument("--json", action="store_true", help="one line: RELAY_VERL_CONTRACT {json}")
    args = parser.parse_args(argv)
    out = report(cpu=args.cpu)
    if args.json:
        print(MARK + json.dumps(out), flush=True)
    else:
        print(f"verl {out['verl']}, torch {out['torch']}: {out['checked']} touch points checked")
        for p in out["problems"]:
            print(f"  ✗ {p}")
        for p in out["loop_bound"]:
            print(f"  ⚠ {p} (chunks then end through total_training_steps: horizon-independent schedules only)")
    return 1 if out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
