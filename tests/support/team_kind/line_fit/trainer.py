"""The chunk contract: resume from the latest valid checkpoint (Relay's session finds and validates it), train
to the chunk's end step, save in verl's layout (what Relay's gate checks), exit."""

from __future__ import annotations

import json
import time

import pyarrow.parquet as pq
import torch

from relay.trainers.contract import ChunkRequest, ChunkResult
from relay.trainers.session import ChunkSession


def resolved_settings(spec, train_rows: int | None = None) -> dict:
    return {"resolved.steps_per_pass": (train_rows or 0) // spec.settings.batch_size}


def _rows(files: list[str]) -> torch.Tensor:
    rows = []
    for f in files:
        for r in pq.read_table(f, columns=["prompt", "reward_model"]).to_pylist():
            a, b = r["prompt"][0]["content"].rstrip("=").split("+")
            rows.append((float(a), float(b), float(r["reward_model"]["ground_truth"])))
    return torch.tensor(rows)


def _save(folder, model, optim, step: int) -> None:
    actor = folder / "actor"
    (actor / "huggingface").mkdir(parents=True)
    torch.save(model.state_dict(), actor / "model_world_size_1_rank_0.pt")
    torch.save(optim.state_dict(), actor / "optim_world_size_1_rank_0.pt")
    torch.save({"step": step}, actor / "extra_state_world_size_1_rank_0.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    (actor / "huggingface" / "config.json").write_text(json.dumps({"model_type": "line_fit"}))
    torch.save({"next_step": step + 1}, folder / "data.pt")


def train_chunk(req: ChunkRequest) -> ChunkResult:
    spec, t0 = req.spec, time.time()
    session = ChunkSession(req)
    start = step = session.resume_step
    torch.manual_seed(spec.seed)
    model = torch.nn.Linear(2, 1)
    optim = torch.optim.SGD(model.parameters(), lr=spec.settings.lr)
    if (resume := session.resume_checkpoint()) is not None:
        model.load_state_dict(torch.load(resume / "actor" / "model_world_size_1_rank_0.pt", weights_only=True))
        optim.load_state_dict(torch.load(resume / "actor" / "optim_world_size_1_rank_0.pt", weights_only=True))
    data = _rows(session.data_files()["train"])
    n, size = len(data), spec.settings.batch_size
    session.begin()
    checkpoint = None
    try:
        while step < req.to_step:
            step += 1
            t = time.time()
            batch = data[[(step * size + i) % n for i in range(size)]]  # the data position is the step's
            loss = torch.nn.functional.mse_loss(model(batch[:, :2]).squeeze(1), batch[:, 2])
            optim.zero_grad()
            loss.backward()
            optim.step()
            session.step_done(step, time.time() - t, loss=float(loss))
            if step == req.to_step or (spec.settings.save_freq and step % spec.settings.save_freq == 0):
                with session.saving(step) as staged:
                    _save(staged, model, optim, step)
                    checkpoint = session.commit(step, staged)
    finally:
        session.finish(step)
    return ChunkResult(req.run.name, start, step, step - start, time.time() - t0, str(checkpoint))
