"""A chunk as verl's trainer sees it, and what the chunk trainer (relay.trainers.verl_ppo.chunk_trainer) uses
that needs no verl: the chunk's payload in verl's config (VerlChunk, attach, detach), the chunk of this actor,
the run's lease and metrics inside the actor (actor_session), a step's metrics row and dataset indices, the
canonical order of a step's samples, and the rollout state kept out of checkpoints.

Light: omegaconf only inside functions, nothing of verl; the job's driver and the tests import it freely.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relay.runs import heartbeat
from relay.runs.metrics import MetricsLog
from relay.trainers.contract import ChunkRequest
from relay.trainers.session import ChunkSession
from relay.trainers.stopping import GracefulStop
from relay.trainers.verl_ppo import tracking

PAYLOAD_KEY = "relay_chunk"  # top-level key the driver adds to verl's config; the TaskRunner pops it


@dataclass
class VerlChunk:
    """What the TaskRunner actor needs from the job's driver (travels inside verl's config, base64 JSON)."""

    request: str  # ChunkRequest JSON, with the lease token the driver holds
    resume_step: int  # the checkpoint Relay validated, that verl must resume from (0: fresh)
    end_step: int  # the loop stops here (the chunk's end; the run's total in supervised mode)
    total_steps: int  # the run's total: the LR schedule's horizon, and the run's real end
    strategy: str  # horizon.LOOP_BOUND or horizon.TOTAL_STEPS
    validate_chunk_end: bool = False
    test_freq: int = -1
    tracking_env: dict = field(default_factory=dict)  # WANDB_RUN_ID, WANDB_RESUME, MLFLOW_RUN_ID...
    run_dir: str = ""
    warm_chunk_steps: int = 0  # chunks.handoff warm: the chunk's length (the loop runs one chunk past the end)
    trainer_mode: str = "sync"  # verl's trainer.v1.trainer_mode: the chunk trainer installed under it

    def encode(self) -> str:
        return base64.b64encode(json.dumps(asdict(self), sort_keys=True).encode()).decode()

    @classmethod
    def decode(cls, blob: str) -> VerlChunk:
        return cls(**json.loads(base64.b64decode(blob)))

    def skip_validation_at(self, step: int) -> bool:
        """verl validates on its last step; only the run's real end (or test_freq, or a spec asking for it) does."""
        return (
            step == self.end_step
            and step < self.total_steps
            and not self.validate_chunk_end
            and not (self.test_freq > 0 and step % self.test_freq == 0)
        )


def attach(config, chunk: VerlChunk) -> None:
    """Put the chunk into verl's config (outside verl's schema; popped before verl reads the config)."""
    from omegaconf import open_dict

    with open_dict(config):
        config[PAYLOAD_KEY] = chunk.encode()


def detach(config) -> VerlChunk | None:
    from omegaconf import open_dict

    if PAYLOAD_KEY not in config:
        return None
    with open_dict(config):
        blob = config.pop(PAYLOAD_KEY)
    return VerlChunk.decode(blob)


# -------------------------------------------------------------------------------- the chunk of this process
_ACTIVE: VerlChunk | None = None


def activate(chunk: VerlChunk) -> None:
    """The chunk this TaskRunner actor trains (chunk_trainer.install)."""
    global _ACTIVE
    _ACTIVE = chunk


def active_chunk() -> VerlChunk:
    if _ACTIVE is None:
        from relay.common.errors import RelayError

        raise RelayError(
            "Relay's chunk trainer was built without a chunk (install() was not called in this process)",
            "run verl through relay.trainers.verl_ppo (the TaskRunner installs the chunk)",
            retry_helps=False,
        )
    return _ACTIVE


# -------------------------------------------------------------------------------- what the trainer uses
# verl writes these into a step folder for its async modes (in-flight rollouts); a sync trainer never
# loads them, and they are not model state. Relay keeps them out of its checkpoints.
ROLLOUT_STATE = ("transfer_queue",)


def remove_rollout_state(step_dir: Path) -> list[str]:
    removed = []
    for name in ROLLOUT_STATE:
        p = Path(step_dir) / name
        if p.exists():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(name)
    return removed


# metrics.jsonl column <- verl metric names, first present wins
METRICS = {
    "reward_mean": ("critic/score/mean", "critic/rewards/mean"),
    "loss": ("actor/pg_loss", "actor/loss"),
    "kl": ("actor/kl_loss", "actor/ppo_kl"),
    "lr": ("actor/lr",),
    "entropy": ("actor/entropy",),
    "response_length": ("response_length/mean",),
}


def metrics_row(metrics: dict) -> dict[str, float]:
    out = {}
    for column, names in METRICS.items():
        for n in names:
            v: Any = metrics.get(n)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[column] = float(v)
                break
            if hasattr(v, "item"):
                try:
                    out[column] = float(v.item())
                    break
                except (TypeError, ValueError):
                    continue
    return out


def plain_values(values) -> list:
    """A TensorDict column (tensor, numpy array or stack of non-tensor data) as a list of plain values."""
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    return [getattr(v, "data", v) for v in values]


def sample_indices(batch) -> list[int] | None:
    """The dataset rows of a prompt batch (RLHFDataset's `index`, from extra_info.index), in batch order."""
    try:
        return [int(v) for v in plain_values(batch["index"])]
    except KeyError:
        return None


def canonical_order(keys: list[str], uid_index: dict[str, int]) -> list[int] | None:
    """The positions of a step's samples sorted by (dataset index, place in the GRPO group, turn).

    verl's agent loop stores each response in TransferQueue under `{uid}_{session_id}_{turn}` as it finishes,
    and the step's batch comes back in that order, which depends on timing. The loss sums over the batch
    in its order, and a float sum in another order differs in its last bits, which Adam can turn into
    whole updates of a parameter whose gradient is near 0: two runs of the same data would not train alike.
    Sorted, they do. None when a key does not have that form (verl changed it): the order is left alone."""
    ranks = []
    for pos, key in enumerate(keys):
        uid, _, rest = str(key).partition("_")
        session, _, turn = rest.partition("_")
        if uid not in uid_index or not session.isdigit() or not turn.isdigit():
            return None
        ranks.append((uid_index[uid], int(session), int(turn), pos))
    return [pos for *_, pos in sorted(ranks)]


def say(msg: str) -> None:
    print(f"[relay-verl] {msg}", flush=True)


def actor_session(chunk: VerlChunk):
    """The parts of ChunkSession the actor needs: the lease (held by the driver, checked here), the
    staged and fenced commit, metrics rows. No resume: the driver validated it already."""

    class ActorSession(ChunkSession):
        def __init__(self, req: ChunkRequest, resume_step: int):  # no super().__init__: nothing to resume
            self.req, self.spec, self.run_dir = req, req.spec, req.run_dir
            self.lease = req.run.folder.lease()
            assert req.lease_token is not None  # the driver took the lease: its token travels in the request
            self.token = req.lease_token
            self.lease.check(self.token)
            self.resume_step = resume_step
            self.metrics = MetricsLog(self.run_dir)
            self._t0 = time.time()
            self._step_times = []
            # Not signalled here (Ray signals the job's driver): the driver's stop file and save_before
            self.stopping = GracefulStop(self.run_dir, req.attempt, self.spec.deadline(), signals=False)
            self._save_started = None
            self._save_s = None
            self._no_certificate = {}

        def record_step(self, step: int, seconds: float, **values) -> None:
            """One metrics.jsonl row (the driver prints the progress line); stop at once if the lease was lost."""
            self.lease.check(self.token)
            if self.awaiting is not None:  # a warm chunk not admitted yet (relay.runs.handoff)
                self._check_admission(step, wait=False)
            self._step_times.append(seconds)
            self.metrics.append(
                {
                    "step": step,
                    "chunk": self.req.chunk,
                    "attempt": self.req.attempt,
                    "seconds": round(seconds, 4),
                    "time": time.time(),
                    **values,
                }
            )
            heartbeat.beat(self.run_dir, self.req.attempt, step)

    return ActorSession(ChunkRequest.from_json(chunk.request), chunk.resume_step)


def record_tracking(trainer) -> None:
    """Keep the tracking run ids of this run (the MLflow run verl started in chunk 1 is reused later)."""

    try:
        tracking.record_active(Path(trainer.relay.run_dir), trainer.config.trainer.logger)
    except Exception as e:  # noqa: BLE001 - tracking is never worth failing a chunk over
        say(f"could not record the tracking run id: {e}")
