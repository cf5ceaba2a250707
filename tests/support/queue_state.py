"""verl's TransferQueue state in a step folder (`transfer_queue/`), written by the queue's own classes as its
controller and storage actors write it at a save (the actors themselves need Ray): the controller's partitions and
index manager, one storage unit holding verl's fields of a rollout batch (token tensors, per-sample tensors of
different lengths, chat messages, reward dicts, numpy and tensordict values), or, with `ssd`, the storage unit
of a queue that offloads to disk: a pickle beside a `.blobs/` folder whose values have no raw form are pickles."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, TensorDict
from transfer_queue.controller import DataPartitionStatus, FieldMeta
from transfer_queue.storage.simple_storage import HybridStorageUnitData, StorageUnitData

UNIT = "TQ_STORAGE_UNIT_0"


def batch(n: int = 4) -> dict[str, list]:
    """One field per key, one value per sample, of the kinds verl's agent loop puts into the queue."""
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": [torch.randint(0, 64, (24,), generator=g) for _ in range(n)],
        "responses": [torch.randint(0, 64, (3 + i,), generator=g) for i in range(n)],  # lengths differ
        "old_log_probs": [torch.randn(5, generator=g).to(torch.bfloat16) for _ in range(n)],
        "prompt": [[{"role": "user", "content": f"{i}+{i}="}] for i in range(n)],
        "reward_model": [{"style": "rule", "ground_truth": str(2 * i)} for i in range(n)],
        "uid": [f"uid-{i}" for i in range(n)],
        "multi_modal": [np.array([{"k": i}, None], dtype=object) for i in range(n)],
        "score": [np.float32(i / 4) for i in range(n)],
        "meta": [TensorDict({"t": torch.ones(2)}, batch_size=[2]) for _ in range(n)],
        "note": [NonTensorData(f"note {i}") for i in range(n)],
    }


def write(step_dir: Path, *, ssd: Path | None = None) -> Path:
    """The queue's checkpoint folder under step_dir, as tq.save_checkpoint lays it out."""
    folder = Path(step_dir) / "transfer_queue"
    (folder / "simple_storage").mkdir(parents=True)
    data = batch()
    keys = list(range(len(data["uid"])))
    partition = DataPartitionStatus(partition_id="train")
    partition.global_indexes = set(keys)
    partition.field_name_mapping = {name: i for i, name in enumerate(data)}
    partition.field_metadata = {"responses": FieldMeta(set(keys), torch.int64, None, True, False, {0: (3,)})}
    partition.consumption_status = {"train": torch.zeros(len(keys), dtype=torch.int8)}
    controller = {
        "controller_id": "TQ_CONTROLLER_0",
        "partitions": {"train": partition.to_snapshot()},
        "index_manager": {
            "partition_to_indexes": {"train": set(keys)},
            "reusable_indexes": [],
            "global_index_counter": len(keys),
            "allocated_indexes": set(keys),
        },
        "sampler": {"_states": {"train": {"actor": {0: {0: keys}}}}},
    }
    with (folder / "controller_state.pkl").open("wb") as f:
        pickle.dump(controller, f, protocol=pickle.HIGHEST_PROTOCOL)
    unit = (
        StorageUnitData(100)
        if ssd is None
        else HybridStorageUnitData(100, str(ssd), run_id="run", unit_id=UNIT, threshold_bytes=1)
    )
    unit.put_data(data, keys)
    unit.save_checkpoint(folder / "simple_storage" / f"su_0_{UNIT}.pkl", UNIT)
    (folder / "simple_storage" / "storage_unit_info.json").write_text(json.dumps([{"position": 0, "storage_unit_id": UNIT}]))
    (folder / "metadata.json").write_text(json.dumps({"storage_saved": True, "user_metadata": {"global_steps": 1}}))
    return folder


def equal(a: Any, b: Any) -> bool:
    """Whether two loaded states are the same objects: containers item by item, tensors and arrays by value and
    dtype, records field by field (the restricted reader's result against pickle.load's)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and all(equal(x, y) for x, y in zip(a.flat, b.flat, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return equal(vars(a), vars(b))
    return bool(a == b)  # sets, scalars, strings
