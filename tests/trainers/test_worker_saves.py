"""Saves off the critical path inside verl's workers (relay.trainers.verl_ppo.worker_saves), in this process: what a
worker does around verl's save, and how the trainer's save thread waits for the workers. verl's own workers run it in
tests/airflow/test_verl_dag.py (CI) and tests/trainers/test_verl_cpu_fit.py (a worker killed while it writes)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from relay.trainers import async_save
from relay.trainers.verl_ppo import worker_saves


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g), "step": seed}


class Manager:
    """Stands in for verl's FSDPCheckpointManager in this process: its save calls `torch.save` through its module's
    global `torch`, as verl's does (verl's own manager: test_verls_manager_saves_off_the_critical_path_...)."""

    def __init__(self, obj):
        self.obj = obj

    def save_checkpoint(self, path):
        torch.save(self.obj, path)


def worker_with(manager) -> SimpleNamespace:
    """verl's worker object as certify.actor_of finds it: worker.actor.engine.checkpoint_manager."""
    return SimpleNamespace(actor=SimpleNamespace(engine=SimpleNamespace(checkpoint_manager=manager)))


def test_a_workers_save_is_written_after_verls_save_returns_with_a_synchronous_saves_bytes(tmp_path):
    (tmp_path / "sync").mkdir()
    sync, deferred, done = tmp_path / "sync" / "model.pt", tmp_path / "model.pt", tmp_path / ".written-0.json"
    torch.save(state(1), sync)  # (torch names the archive's folder after the file: the same name)
    manager = Manager(state(1))
    for step in (2, 4):  # the same buffers from one save to the next
        worker_saves.defer(worker_with(manager), step)
        torch.save(state(5), tmp_path / "elsewhere.pt")  # not verl's checkpoint manager saving: torch's own save
        assert (tmp_path / "elsewhere.pt").exists(), "only verl's checkpoint manager's saves are deferred"
        manager.save_checkpoint(deferred)  # verl's save, in the worker
        assert not deferred.exists(), "collected, not written, while verl's save runs"
        took = worker_saves.write_behind(None, str(done))
        assert took["written_now"] == [] and took["bytes"] > 64 * 32 * 4
        [result] = worker_saves.wait_written([done], lambda: None)
        assert result["ok"] and result["files"] == ["model.pt"]
        assert deferred.read_bytes() == sync.read_bytes()
        done.unlink()
        deferred.unlink()
    manager.save_checkpoint(tmp_path / "after.pt")  # verl's checkpoint manager is its own again
    assert (tmp_path / "after.pt").exists() and "save_checkpoint" not in vars(manager)


def test_a_copy_that_does_not_fit_is_written_at_once_and_said(tmp_path, monkeypatch):
    """Raising in one rank would leave the others waiting at verl's next barrier: the shard is written now."""
    monkeypatch.setattr(async_save, "no_room_for", lambda need: "needs 9.00 GiB more of host buffers" if need else None)
    manager = Manager(state(6))
    worker_saves.defer(worker_with(manager), 6)
    Manager(state(7)).save_checkpoint(tmp_path / "unrelated.pt")  # another manager of the class: not intercepted
    assert (tmp_path / "unrelated.pt").exists()
    manager.save_checkpoint(tmp_path / "optim.pt")
    assert (tmp_path / "optim.pt").exists(), "written at once"
    took = worker_saves.write_behind(None, str(tmp_path / "done.json"))
    assert took["written_now"] == ["optim.pt: its host copy needs 9.00 GiB more of host buffers"]
    [result] = worker_saves.wait_written([tmp_path / "done.json"], lambda: None)
    assert result["ok"] and result["files"] == []
    assert torch.load(tmp_path / "optim.pt")["step"] == 6


def test_an_actor_and_a_critic_colocated_in_one_worker_save_both_off_the_critical_path(tmp_path):
    """verl colocates the actor's and the critic's roles in one Ray actor (its WorkerDict): one defer intercepts both
    checkpoint managers, and their shards, which have the same file names in actor/ and critic/, keep their own
    buffers: each file is its own synchronous save's bytes."""
    actor, critic = Manager(state(1)), Manager({**state(2), "value_head": torch.ones(3)})
    worker = SimpleNamespace(
        worker_dict={
            "actor_rollout_ref": worker_with(actor),
            "critic": SimpleNamespace(actor=None, engine=SimpleNamespace(checkpoint_manager=critic)),
        }
    )
    assert worker_saves.checkpoint_managers(worker) == {"actor": actor, "critic": critic}
    sync, deferred, done = tmp_path / "sync", tmp_path / "async", tmp_path / ".written-0.json"
    for folder, manager in (("actor", actor), ("critic", critic)):
        (sync / folder).mkdir(parents=True)
        (deferred / folder).mkdir(parents=True)
        manager.save_checkpoint(sync / folder / "model.pt")
    worker_saves.defer(worker, 2)
    for folder, manager in (("actor", actor), ("critic", critic)):
        manager.save_checkpoint(deferred / folder / "model.pt")
    assert not list(deferred.rglob("*.pt")), "both collected while verl's saves run"
    worker_saves.write_behind(worker, str(done))
    [result] = worker_saves.wait_written([done], lambda: None)
    assert result["ok"] and sorted(result["files"]) == ["model.pt", "model.pt"]
    for folder in ("actor", "critic"):
        assert (deferred / folder / "model.pt").read_bytes() == (sync / folder / "model.pt").read_bytes(), folder


def test_the_commit_waits_for_every_worker_and_refuses_a_failed_or_gone_one(tmp_path):
    done = [tmp_path / f".written-{i}.json" for i in range(2)]
    done[0].write_text(json.dumps({"ok": True, "pid": 11}))
    done[1].write_text(json.dumps({"ok": False, "pid": 12, "error": "OSError: [Errno 28] No space left on device"}))
    with pytest.raises(RuntimeError, match=r"failed to write its part of the checkpoint \(pid 12\): OSError: .*No space"):
        worker_saves.wait_written(done, lambda: None)
    done[1].unlink()
    with pytest.raises(RuntimeError, match="a worker stopped before writing its part of the checkpoint: worker 1"):
        worker_saves.wait_written(done, lambda: "worker 1 (ActorDiedError: ...)", check_every_s=0)


def test_the_ranks_digests_of_their_copies_add_up_to_the_whole_models():
    """Each worker digests its own pieces of the saved shards (at their global offsets); the trainer's sum over the
    ranks is the digest of the whole tensors, as the live check's all-reduce makes it."""
    from relay.checkpoints import certificate

    weight, moment = torch.randn(6, 4), torch.randn(6, 4)
    ranks = [
        {
            "ok": True,
            "digests": {
                "params": certificate._digests([("w", (weight[r * 3 : r * 3 + 3], r * 12))]),
                "optimizer": certificate._digests([("w.exp_avg", (moment[r * 3 : r * 3 + 3], r * 12))]),
                "steps": [4],
            },
        }
        for r in (0, 1)
    ]
    params, moments, steps = worker_saves.summed([*ranks, {"ok": True}])  # a critic worker's note has no digests
    assert params == certificate.digests([("w", weight)]) and moments == certificate.digests([("w.exp_avg", moment)])
    assert steps == [4]
    with pytest.raises(RuntimeError, match="the saved model shard lacks"):
        worker_saves.summed([ranks[0], {"ok": True, "digest_error": "RuntimeError: the saved model shard lacks w"}])
    with pytest.raises(RuntimeError, match="no actor worker digested"):
        worker_saves.summed([{"ok": True}])


def test_tensors_that_share_storage_stay_shared_in_the_copy_with_a_synchronous_saves_bytes(tmp_path):
    """Tied embeddings (one tensor under two names), a view at an offset, a DTensor-free state dict as a world size 1
    shard holds it: the deferred save writes what torch.save writes, the shared storage once (a copy per tensor
    doubled it and lost the aliasing)."""
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(64, 32, generator=g)
    fused = torch.randn(96, 32, generator=g)
    sd = {"embed.weight": embed, "lm_head.weight": embed, "q": fused[:32], "k": fused[32:64], "v": fused[64:]}
    sync = tmp_path / "sync" / "model.pt"
    sync.parent.mkdir()
    torch.save(sd, sync)
    buffers = async_save.HostBuffers()
    for _ in range(2):  # the same buffers from one save to the next
        deferred = async_save.DeferredWrites(buffers)
        manager = Manager(sd)
        with deferred.intercepting(manager):
            manager.save_checkpoint(tmp_path / "model.pt")
        deferred.write()
        assert (tmp_path / "model.pt").read_bytes() == sync.read_bytes()
    assert buffers.nbytes == (64 + 96) * 32 * 4, "one buffer per storage"
    copy = deferred.copied("model.pt")
    assert copy["embed.weight"].untyped_storage().data_ptr() == copy["lm_head.weight"].untyped_storage().data_ptr()
    assert copy["k"].storage_offset() == 32 * 32 and torch.equal(copy["k"], fused[32:64])


@pytest.mark.processes
@pytest.mark.parametrize(("world_size", "fsdp"), [(1, 2), (2, 2), (2, 1)])
def test_verls_manager_saves_off_the_critical_path_a_synchronous_saves_bytes_tied_and_resumes_bitwise(
    tmp_path, world_size, fsdp
):
    """verl's own FSDPCheckpointManager, in gloo processes, on a model with tied embeddings: the step saved as Relay's
    workers save off the critical path (worker_saves) has the synchronous save's bytes in every file of every rank;
    verl's load of that async save, saved again, holds the synchronous save's values bit for bit (weights, optimizer
    moments, scheduler and RNG: the resume loses nothing)."""
    from support import verl_checkpoint

    sync, deferred, resumed = tmp_path / "sync", tmp_path / "async", tmp_path / "resumed"
    common = {"world_size": world_size, "fsdp": fsdp, "tied": True, "hidden": 64}
    verl_checkpoint.make_many(
        [{"run_dir": sync, "deferred_to": deferred, **common}, {"run_dir": resumed, "load_from": deferred, **common}]
    )
    files = sorted(p.relative_to(sync) for p in (sync / "global_step_1" / "actor").rglob("*") if p.is_file())
    shards = [f for f in files if f.suffix == ".pt"]
    assert len(shards) == 3 * world_size, files  # model, optim and extra state of every rank
    for f in files:
        assert (deferred / f).read_bytes() == (sync / f).read_bytes(), f"{f}: not the synchronous save's bytes"
        if f.suffix == ".pt":
            assert_same_values(torch.load(resumed / f, weights_only=False), torch.load(sync / f, weights_only=False), f)
    results = [json.loads((deferred / f".written-{r}.json").read_text()) for r in range(world_size)]
    assert all(r["ok"] and len(r["files"]) == 3 for r in results), results


def assert_same_values(got, want, where) -> None:
    """Every tensor bit for bit (a DTensor's shard, its dtype) and every other value equal, at every key."""
    if isinstance(want, torch.Tensor):
        got, want = getattr(got, "_local_tensor", got), getattr(want, "_local_tensor", want)
        assert got.dtype == want.dtype and torch.equal(got, want), f"{where}: differs"
    elif isinstance(want, dict):
        assert sorted(map(str, got)) == sorted(map(str, want)), f"{where}: keys differ"
        for k in want:
            assert_same_values(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: lengths differ"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_values(g, w, f"{where}[{i}]")
    elif hasattr(want, "tobytes"):  # numpy's RNG state
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), f"{where}: differs"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"
