"""verl's FSDP checkpoints saved off the critical path (`checkpoints.async_save`), inside verl's own workers.

verl saves asynchronously only for Megatron; its FSDP workers write their shards with `torch.save` while training
waits. Relay runs verl's save as it is, with the `torch.save` of verl's checkpoint manager deferred in every worker
while it saves (relay.trainers.async_save: each object mirrored into host buffers kept from one save to the next),
so verl's barriers and its small files (the Hugging Face config, fsdp_config.json) stay on the workers' main
threads, and then a thread of each worker writes its copies and fsyncs them while the next steps train:

- `defer(worker, step)` (Ray's `__ray_call__` on every worker of the group, before verl's save): the worker's
  checkpoint manager's `save_checkpoint` collects what it would `torch.save`; a save of this worker still being
  written is waited for first (one in flight);
- verl's own `save_checkpoint` runs on the workers, as always;
- `write_behind(worker, done)` (after it): the checkpoint manager is verl's own again, and a thread writes the
  copies, fsyncs them and then writes `done` (JSON: ok, or the error), atomically. For an actor worker of an FSDP2
  model (`digest`), the thread also digests its copies of the model's and the optimizer's shards for the step's
  certificate (relay.checkpoints.certificate: this rank's pieces, summed over the ranks by the trainer), so that
  only the certificate's probe runs while training waits.

The trainer's save thread (ChunkSession.save_off_critical_path) waits for every worker's `done` file and only then
commits under the lease: the tracker names a checkpoint only once every rank has written its files. An object
whose copy does not fit in the host's available memory is written at once, on the worker's main thread (said in
its `done` file), rather than raising in one rank while the others wait at verl's next barrier.

It runs inside verl's worker processes; it imports neither verl nor Ray at module level.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay.common import files
from relay.common.faultpoint import fault_point
from relay.trainers.async_save import DeferredWrites, HostBuffers

# This worker process's state: its buffers (kept from save to save), the save being collected and the thread
# writing the one before.
_buffers = HostBuffers()
_collecting: dict[str, Any] = {}
_writer: threading.Thread | None = None


def defer(worker: Any, step: int, digest: bool = False) -> None:
    """In one worker, before verl's save of `step`: its checkpoint manager's `torch.save` calls are collected into host
    buffers while it saves. `digest`: the certificate's digests will be taken from the copies (an actor worker of an
    FSDP2 model)."""
    global _writer
    if _writer is not None:  # at most one save in flight, in this worker too
        _writer.join()
        _writer = None
    deferred = DeferredWrites(_buffers, when_no_room="write")
    context = deferred.intercepting(*checkpoint_managers(worker).values())
    context.__enter__()
    _collecting.update(deferred=deferred, context=context, step=step)
    if digest:
        from relay.checkpoints import certificate
        from relay.trainers.verl_ppo.certify import actor_of

        engine = actor_of(worker).actor.engine
        # the names the certificate digests, as the module holds them now (the live check's names at a resume)
        _collecting["names"] = [name for name, _ in certificate.named_state(engine.module)]


def write_behind(worker: Any, done: str) -> dict[str, Any]:
    """In one worker, after verl's save: the checkpoint manager verl's own again, and a thread writes what was
    collected, fsyncs it and writes `done`. Returns what it took: the bytes copied and the files written at once for
    want of memory."""
    global _writer
    if not _collecting:
        raise RuntimeError("write_behind without defer: Relay's async save was not started in this worker")
    deferred: DeferredWrites = _collecting.pop("deferred")
    step: int = _collecting.pop("step")
    names: list[str] | None = _collecting.pop("names", None)
    _collecting.pop("context").__exit__(None, None, None)

    def write() -> None:
        t0 = time.time()
        try:
            deferred.write(before=lambda path: fault_point("mid_save", step))
            for _, path in deferred.writes:
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            result: dict[str, Any] = {"ok": True, "seconds": round(time.time() - t0, 3)}
        except BaseException as e:  # noqa: BLE001 - said in the done file; the trainer's save thread raises it
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if names is not None and result["ok"]:
            try:
                result["digests"] = _digests_of_copies(worker, deferred, names)
            except Exception as e:  # noqa: BLE001 - the certificate is then skipped, saying why; the save stands
                result["digest_error"] = f"{type(e).__name__}: {e}"
        result.update(pid=os.getpid(), files=[p.name for _, p in deferred.writes], written_now=deferred.written_now)
        files.atomic_write_json(Path(done), result)

    _writer = threading.Thread(target=write, name=f"relay-save-write-{step}")
    _writer.start()
    return {"bytes": _buffers.nbytes, "written_now": deferred.written_now}


def _digests_of_copies(worker: Any, deferred: DeferredWrites, names: list[str]) -> dict[str, Any]:
    """This rank's part of the certificate's digests, from its copies of the shards verl saved: each parameter's and
    each optimizer moment's pieces at their global offsets (DTensor copies keep their specs), not yet summed over the
    ranks; and the parameters' optimizer steps."""
    from relay.checkpoints import certificate
    from relay.trainers.verl_ppo.certify import actor_of

    saved = {path.name.partition("_world_size_")[0]: obj for obj, path in deferred.writes if path.parent.name == "actor"}
    model, optim = saved.get("model"), saved.get("optim")
    if not isinstance(model, dict) or not isinstance(optim, dict):
        raise RuntimeError("verl saved no model or optimizer shard in this worker")
    if missing := [n for n in names if n not in model]:
        raise RuntimeError(f"the saved model shard lacks {', '.join(missing[:3])}")
    engine = actor_of(worker).actor.engine
    moments, steps = certificate.optimizer_digests_of_copy(engine.module, engine.optimizer, optim)
    return {"params": certificate.digests((n, model[n]) for n in names), "optimizer": moments, "steps": steps}


def summed(results: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, str], list[int]]:
    """In the trainer: the workers' digests summed over the ranks (each a sum modulo 2^64, as the all-reduce of the
    live check adds them): (parameters, optimizer moments, steps). RuntimeError naming why where a worker has none."""
    parts = [r for r in results if "digests" in r or "digest_error" in r]
    if why := next((r["digest_error"] for r in parts if "digest_error" in r), None):
        raise RuntimeError(why)
    if not parts:
        raise RuntimeError("no actor worker digested its copies")

    def add(kind: str) -> dict[str, str]:
        total: dict[str, int] = {}
        for r in parts:
            for name, h in r["digests"][kind].items():
                total[name] = (total.get(name, 0) + int(h, 16)) & ((1 << 64) - 1)
        return {n: f"{v:016x}" for n, v in total.items()}

    return add("params"), add("optimizer"), sorted({s for r in parts for s in r["digests"]["steps"]})


def checkpoint_managers(worker: Any) -> dict[str, Any]:
    """The worker's verl checkpoint managers (each engine's FSDPCheckpointManager) by the step folder each saves into:
    the actor's, the critic's, or both where verl colocates the roles in one Ray actor."""
    from relay.trainers.verl_ppo.certify import actor_of, critic_of

    found = {}
    for folder, engine_of in (("actor", lambda w: actor_of(w).actor.engine), ("critic", lambda w: critic_of(w).engine)):
        try:
            found[folder] = engine_of(worker).checkpoint_manager
        except RuntimeError:
            continue  # not this role's worker
    if not found:
        raise RuntimeError(f"no actor or critic engine in {type(worker).__name__}: verl's worker layout changed")
    return found


def prepare(worker: Any) -> str:
    """In one worker, before the first step: its host buffers allocated for what verl's saves will write (every role
    the worker holds)."""
    from relay.trainers.async_save import prepare as allocate

    return allocate(_buffers, checkpoint_managers(worker))


def ping(worker: Any) -> bool:
    """Whether the worker answers (the save thread's check that a worker it waits for is still alive)."""
    return True


def wait_written(
    done: list[Path], gone: Callable[[], str | None], *, poll_s: float = 0.02, check_every_s: float = 5.0
) -> list[dict]:
    """In the trainer (its save thread): wait for every worker's `done` file; raise if one failed, or if `gone()`
    names a worker that no longer answers (its files will never be written). Returns the workers' results."""
    results: dict[Path, dict] = {}
    checked = time.time()
    while len(results) < len(done):
        for path in done:
            if path not in results and path.exists():
                results[path] = json.loads(path.read_text())
        if len(results) == len(done):
            break
        if time.time() - checked >= check_every_s:
            checked = time.time()
            if (which := gone()) is not None:
                raise RuntimeError(f"a worker stopped before writing its part of the checkpoint: {which}")
        time.sleep(poll_s)
        poll_s = min(poll_s * 2, 0.5)
    failed = [r for r in results.values() if not r.get("ok")]
    if failed:
        raise RuntimeError(
            f"a worker failed to write its part of the checkpoint (pid {failed[0].get('pid')}): {failed[0]['error']}"
        )
    return list(results.values())
