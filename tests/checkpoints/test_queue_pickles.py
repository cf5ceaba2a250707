"""verl's TransferQueue pickles in a checkpoint (relay.checkpoints.queue_pickles): what the queue writes loads through
the restricted unpickler to the same objects as through pickle.load; a crafted pickle is refused, naming the type it
asked for, and nothing in it runs (each payload would create a file)."""

from __future__ import annotations

import collections
import os
import pickle

import pytest
import torch

from relay.checkpoints import queue_pickles
from relay.common.errors import UnsafeCheckpointError
from support import queue_state


def queue_files(folder):
    return [
        p
        for p in sorted(folder.rglob("*"))
        if p.is_file() and queue_pickles.is_queue_pickle(str(p.relative_to(folder.parent)), p.read_bytes()[:2])
    ]


@pytest.mark.parametrize("ssd", [False, True], ids=["in memory", "offloaded to disk"])
def test_what_the_queue_writes_loads_to_the_same_objects_as_pickle_load(tmp_path, ssd):
    folder = queue_state.write(tmp_path / "global_step_1", ssd=tmp_path / "ssd" if ssd else None)
    files = queue_files(folder)
    assert [p.name for p in files] == ["controller_state.pkl", f"su_0_{queue_state.UNIT}.pkl"]
    for path in files:
        with path.open("rb") as f:
            plain = pickle.load(f)
        assert queue_state.equal(queue_pickles.load(path), plain), path
    if ssd:  # the values with no raw form are pickles in the blobs folder, which the storage unit's pickle indexes
        index = pickle.loads(files[1].read_bytes())["ssd_index"]
        assert {m["codec"] for entries in index.values() for m in entries.values()} >= {"pickle", "tensor"}


class Payload:
    """What a crafted pickle runs at unpickling: a shell command that creates a file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def in_storage_bytes(payload) -> bytes:
    """A tensor storage's pickle whose bytes (read by torch.storage._load_from_bytes, i.e. torch.load with
    weights_only=False) carry the payload: allow-listing that function as it is would run it."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    inner = b"".join(pickle.dumps(x, protocol=2) for x in (MAGIC_NUMBER, PROTOCOL_VERSION, {}, payload, []))

    class Storage:
        def __reduce__(self):
            return torch.storage._load_from_bytes, (inner,)

    return pickle.dumps({"field_data": {"input_ids": {0: Storage()}}})


class HookedTensor:
    def __reduce__(self):
        rebuild, args = torch.zeros(2).__reduce_ex__(2)
        return rebuild, (*args[:5], collections.OrderedDict(a=1))


class OtherTd:
    def __reduce__(self):
        from tensordict._reductions import _make_td

        return _make_td, (collections.OrderedDict, {})


SYSTEM = f"{os.system.__module__}.system"  # posix.system


@pytest.mark.parametrize(
    "crafted,needs",
    [
        (lambda m: pickle.dumps({"controller_id": Payload(m)}), SYSTEM),
        (lambda m: in_storage_bytes(Payload(m)), SYSTEM),
        (lambda m: pickle.dumps(HookedTensor()), "backward hooks"),
        (lambda m: pickle.dumps(OtherTd()), "_make_td of <class 'collections.OrderedDict'>"),
        (lambda m: pickle.dumps({"sampler": eval}), "builtins.eval"),
    ],
    ids=[
        "a function call",
        "inside a tensor's storage bytes",
        "a tensor with backward hooks",
        "another class as a TensorDict",
        "a builtin",
    ],
)
def test_a_crafted_pickle_is_refused_naming_the_type_and_nothing_runs(tmp_path, crafted, needs):
    marker = tmp_path / "ran"
    path = tmp_path / "controller_state.pkl"
    path.write_bytes(crafted(marker))
    with pytest.raises(UnsafeCheckpointError) as e:
        queue_pickles.load(path)
    assert needs in e.value.what and str(path) in e.value.what, e.value.what
    assert not marker.exists(), "the payload ran"


def test_a_crafted_blob_of_a_queue_offloaded_to_disk_is_refused(tmp_path):
    folder = queue_state.write(tmp_path / "global_step_1", ssd=tmp_path / "ssd")
    unit = folder / "simple_storage" / f"su_0_{queue_state.UNIT}.pkl"
    index = pickle.loads(unit.read_bytes())["ssd_index"]
    name = next(m["filename"] for entries in index.values() for m in entries.values() if m["codec"] == "pickle")
    marker = tmp_path / "ran"
    (folder / "simple_storage" / f"{unit.name}.blobs" / name).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpointError) as e:
        queue_pickles.load(unit)
    assert SYSTEM in e.value.what and name in e.value.what and not marker.exists()


def test_only_pickles_under_transfer_queue_are_queue_pickles():
    head = pickle.dumps({})[:2]
    assert queue_pickles.is_queue_pickle("transfer_queue/anything.bin", head)
    assert not queue_pickles.is_queue_pickle("transfer_queue/su_0.pkl.blobs/ab.bin", head)  # its codec decides
    assert not queue_pickles.is_queue_pickle("transfer_queue/metadata.json", b"{\n")
    assert not queue_pickles.is_queue_pickle("actor/huggingface/x.pkl", head)
