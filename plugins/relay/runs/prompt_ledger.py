"""The prompt ledger of verl's asynchronous trainers: every prompt handed out for generation, until it is trained.

In verl's async modes the batch a step trains is not the batch it fetched: prompts are handed out ahead (the
warm-up batches, then one batch a step) and trained steps later. Each prompt gets a number when it is handed out
(`seq`: the run's count of prompts fetched from the dataloader, continued across chunks and resumes), and keeps
its dataset row (`index`) and the step that handed it out. verl knows a prompt by a random uuid; the ledger maps
it to that identity, so that

- the sampler trains prompts first in, first out (relay.trainers.verl_ppo.async_trainer.FirstInFirstOut),
- a step's batch is put in one order (by seq) whatever order its responses finished in,
- each metrics row says which prompts the step trained (`sample_indices`, `prompt_seqs`, `policy_versions`),
  which it handed out (`handed_out_seqs`), which verl evicted and why (`evicted_seqs`, `evicted_reasons`: a failed
  rollout, a stale group under stale_strategy drop, a filtered one) and which a resume re-issued (`reissued_seqs`), and
- a checkpoint lists the prompts in flight at its step (PROMPTS, JSON: read without unpickling), checked against
  what verl restores into its TransferQueue before the first step.

relay.insights.prompts proves from the rows that each prompt handed out was trained exactly once.
Plain Python: no verl import (the audit and the tests read it anywhere).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relay.common.errors import CheckpointError, RelayError
from relay.common.files import atomic_write_json

PROMPTS = "relay_prompts.json"  # in a step folder of an async run: the prompts in flight at that step
VERSION = 2  # 2: exactness and max_staleness (a version 1 ledger is bitwise)


@dataclass
class Prompt:
    uid: str  # verl's key for it in TransferQueue (a random uuid)
    seq: int  # its number among the run's prompts handed out
    index: int  # its dataset row (RLHFDataset's index)
    handed_out_at: int  # the step that handed it out (verl's global_steps then)


class PromptLedger:
    def __init__(self) -> None:
        self.next_seq = 0
        self.live: dict[str, Prompt] = {}  # handed out, not trained
        self.handed_since_row: list[tuple[int, int]] = []  # (seq, dataset index) handed out since the last row
        self.evicted_since_row: list[tuple[int, int, str]] = []  # (seq, dataset index, reason) evicted since then
        self.reissued_since_row: list[int] = []  # seqs a resume handed out again (their generation started over)
        self.warmup_batches = 0
        self.exactness = "bitwise"  # relay.trainers.verl_ppo.async_trainer: bitwise | lossless
        self.max_staleness: int | None = None  # lossless: the most policy versions a trained prompt spans

    # ---- as the trainer goes
    def hand_out(self, uids: list[str], indices: list[int], step: int) -> None:
        for uid, index in zip(uids, indices, strict=True):
            self.live[uid] = Prompt(uid, self.next_seq, int(index), step)
            self.handed_since_row.append((self.next_seq, int(index)))
            self.next_seq += 1

    def train(self, uids: list[str]) -> list[Prompt]:
        """The prompts a step trained (its batch's uids, each once), in seq order; they leave the ledger."""
        uids = list(dict.fromkeys(uids))
        unknown = [u for u in uids if u not in self.live]
        if unknown:
            raise RelayError(
                f"the step trained {len(unknown)} prompt(s) the ledger never handed out (uids {unknown[:3]}): "
                "verl sampled prompts Relay did not see fetched",
                "pin verl 0.9.1 (its _submit_batch_to_rollout hands every prompt out)",
                retry_helps=False,
            )
        return sorted((self.live.pop(u) for u in uids), key=lambda p: p.seq)

    def evict(self, reasons: dict[str, str]) -> list[Prompt]:
        """Prompts verl evicted (uid -> reason: rollout_failure, stale or filtered): they leave the ledger, accounted for."""
        out = []
        for uid, reason in reasons.items():
            p = self.live.pop(uid, None)
            if p is not None:
                self.evicted_since_row.append((p.seq, p.index, reason))
                out.append(p)
        return out

    def reissued(self, uids: list[str]) -> list[Prompt]:
        """Prompts in flight at a checkpoint that a resume handed out again (they stay in the ledger)."""
        out = sorted((self.live[u] for u in uids if u in self.live), key=lambda p: p.seq)
        self.reissued_since_row += [p.seq for p in out]
        return out

    def row_done(self) -> list[tuple[int, int]]:
        """The prompts (seq, dataset index) handed out since the last row (for this row), and start a new count."""
        out, self.handed_since_row = self.handed_since_row, []
        return out

    def row_fields(self) -> dict[str, Any]:
        """This row's prompts handed out, evicted and re-issued since the last row, and start new counts."""
        handed = self.row_done()
        evicted, self.evicted_since_row = self.evicted_since_row, []
        reissued, self.reissued_since_row = self.reissued_since_row, []
        row: dict[str, Any] = {"handed_out_seqs": [seq for seq, _ in handed], "handed_out_indices": [i for _, i in handed]}
        if evicted:
            row.update(
                evicted_seqs=[seq for seq, _, _ in evicted],
                evicted_indices=[i for _, i, _ in evicted],
                evicted_reasons=[why for _, _, why in evicted],
            )
        if reissued:
            row["reissued_seqs"] = reissued
        return row

    def order(self, uid: str) -> int | None:
        p = self.live.get(uid)
        return p.seq if p else None

    def seq_by_uid(self) -> dict[str, int]:
        return {u: p.seq for u, p in self.live.items()}

    def drop(self, uids: list[str]) -> list[Prompt]:
        """Forget prompts as a framework that loses its in-flight batch does (the fault suite's drop only)."""
        return [self.live.pop(u) for u in uids if u in self.live]

    # ---- in a checkpoint
    def write(self, step_dir: Path, step: int, warmup_batches: int) -> Path:
        path = Path(step_dir) / PROMPTS
        body = {
            "version": VERSION,
            "step": step,
            "warmup_batches": warmup_batches,
            "exactness": self.exactness,
            "max_staleness": self.max_staleness,
            "next_seq": self.next_seq,
            "in_flight": [asdict(p) for p in sorted(self.live.values(), key=lambda p: p.seq)],
        }
        atomic_write_json(path, body)
        return path

    @classmethod
    def read(cls, step_dir: Path) -> PromptLedger:
        path = Path(step_dir) / PROMPTS
        try:
            body = json.loads(path.read_text())
            ledger = cls()
            ledger.next_seq = int(body["next_seq"])
            ledger.warmup_batches = int(body["warmup_batches"])
            ledger.exactness = str(body.get("exactness", "bitwise"))
            bound = body.get("max_staleness")
            ledger.max_staleness = int(bound) if bound is not None else None
            for p in body["in_flight"]:
                ledger.live[p["uid"]] = Prompt(str(p["uid"]), int(p["seq"]), int(p["index"]), int(p["handed_out_at"]))
        except FileNotFoundError:
            raise CheckpointError(
                f"{path} is missing: this checkpoint of an asynchronous run does not say which prompts were in flight "
                "at its step, so a resume could skip or repeat them",
                "resume from an earlier checkpoint saved in this trainer_mode (`relay doctor SPEC --run RUN` lists the "
                "valid ones), or start the run again",
            ) from None
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is unreadable ({e})", "resume from an earlier checkpoint") from None
        return ledger


def expected_staleness(step: int, warmup_batches: int, first_step: int = 1) -> int:
    """Steps between the policy a step's samples were generated with and the one that trains them, when every prompt
    is generated under the weights it was handed out with and trained first in, first out: the warm-up batches of
    the run's first step were generated by its initial weights, every later batch `warmup_batches` steps ahead."""
    return min(step - first_step, warmup_batches)
