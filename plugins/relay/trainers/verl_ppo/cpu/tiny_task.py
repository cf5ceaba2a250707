"""The tiny model's task for verl's own trainer on a CPU: two-number addition ("12+7=" -> "19"), with a
partial-credit reward that a random byte-level model already scores unevenly.

Three pieces, used by include/runs/verl_tiny_cpu.yaml:

- make_dataset(folder): train.parquet and val.parquet in verl's RL schema (examples/data_preprocess/
  gsm8k.py): data_source, prompt as a chat list of {role, content}, ability, reward_model {style: rule,
  ground_truth}, extra_info {split, index, question, answer}. Prompts are a few bytes, so after the tiny
  tokenizer's chat template (one token per byte) they stay far below max_prompt_length 64.
- compute_score(...): the custom reward function verl's reward loop calls (verl 0.9.1: the naive reward
  manager, verl/experimental/reward_loop/reward_manager/naive.py, calls compute_score(data_source=...,
  solution_str=..., ground_truth=..., extra_info=...) and, with a reward model router, two more keyword
  arguments). GRPO's advantage is a score minus its group's mean: an all-or-nothing reward gives a
  random model 0 everywhere and nothing trains, so the score grows by degrees (digits at all, the first
  number's first digit, its length, its digits) up to 1.0 for exactly the answer.
- where verl finds that function: verl's load_module (verl/utils/import_utils.py) takes a file path or
  `pkg://<module>`. REWARD_MODULE is the pkg:// form, which a spec can write as it is; every verl process
  of a CPU job imports Relay already (VERL_USE_EXTERNAL_MODULES names Relay's cpu platform), so the
  module is importable wherever the reward loop runs. reward_function_path() is this file's path.

No verl or torch import here: the module is imported by verl's reward workers and by spec checks alike.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

from relay.common.errors import RelayError

DATA_SOURCE = "relay_tiny_arith"
ABILITY = "math"
MAX_OPERAND = 99  # two-digit operands: answers of 1 to 3 digits, so length and first digit both carry signal
REWARD_MODULE = "pkg://relay.trainers.verl_ppo.cpu.tiny_task"  # verl's reward.custom_reward_function.path
REWARD_FUNCTION = "compute_score"  # verl's reward.custom_reward_function.name

_NUMBER = re.compile(r"[0-9]+")  # ASCII digits only: \d would also take other scripts' digits


def question(a: int, b: int) -> str:
    return f"{a}+{b}="


def _problems(rng: random.Random, rows: int, exclude: set[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    while len(out) < rows:
        pair = (rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND))
        if pair not in exclude:
            out.append(pair)
    return out


def _records(pairs: list[tuple[int, int]], split: str) -> list[dict]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question(a, b)}],
            "ability": ABILITY,
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "question": question(a, b), "answer": str(a + b)},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def make_dataset(
    folder: str | os.PathLike, train_rows: int = 256, val_rows: int = 16, seed: int = 0
) -> dict[str, list[str]]:
    """Write train.parquet and val.parquet into `folder` (created); the same rows for the same seed.

    Validation problems never appear in train (held out), so validation measures more than recall.
    Returns {"train": [path], "val": [path]}, the shape Relay's data files take (overrides.chunk_overrides).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if train_rows < 1 or val_rows < 1:
        raise RelayError(
            f"tiny dataset: train_rows ({train_rows}) and val_rows ({val_rows}) must be >= 1",
            "ask for at least one row of each",
            retry_helps=False,
        )
    pairs_available = (MAX_OPERAND + 1) ** 2
    if train_rows + val_rows > pairs_available:
        raise RelayError(
            f"tiny dataset: {train_rows} + {val_rows} rows, but only {pairs_available} distinct "
            "problems exist to hold validation out of train",
            "ask for fewer rows",
            retry_helps=False,
        )
    rng = random.Random(seed)  # one stream: val drawn first, then train without the val problems
    val = _problems(rng, val_rows, set())
    train = _problems(rng, train_rows, set(val))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[str]] = {}
    for split, pairs in (("train", train), ("val", val)):
        path = folder / f"{split}.parquet"
        # Written beside, then renamed: a spec check or a chunk reading the file never sees half of it.
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        pq.write_table(pa.Table.from_pylist(_records(pairs, split)), tmp)
        os.replace(tmp, path)
        out[split] = [str(path.resolve())]
    return out


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, **kwargs) -> float:
    """The reward of one response, in [0, 1]; 1.0 only for exactly the answer.

    Partial credit (at most 0.9 without exactly the answer), so that a random model's responses differ:
      0.2 x the share of digits among the response's characters (a random byte is rarely a digit);
      for its first number: 0.1 for having one, 0.15 for the right first digit, 0.1 for the right number
      of digits, 0.2 x the share of the answer's digits it has in place (counted from the units), and
      0.15 when it is the answer (the answer followed by more text beats any wrong number).
    `solution_str` is the response as verl decodes it (special tokens skipped); `extra_info` and any
    other keyword (verl passes reward_router_address and reward_model_tokenizer with a reward model)
    are not used.
    """
    if data_source != DATA_SOURCE:
        raise RelayError(
            f"the tiny arithmetic reward was asked to score data_source {data_source!r}; it only knows {DATA_SOURCE!r}",
            "point reward.custom_reward_function at the reward of that data, or make the data with "
            "relay.trainers.verl_ppo.cpu.tiny_task.make_dataset",
            retry_helps=False,
        )
    truth = str(ground_truth).strip()
    text = (solution_str or "").strip()
    if text == truth:
        return 1.0
    score = 0.0
    if text:
        score += 0.2 * sum(c in "0123456789" for c in text) / len(text)
    m = _NUMBER.search(text)
    if m and truth:
        number = m.group()
        score += 0.1
        if number[0] == truth[0]:
            score += 0.15
        if len(number) == len(truth):
            score += 0.1
        in_place = sum(1 for x, y in zip(reversed(number), reversed(truth), strict=False) if x == y)
        score += 0.2 * in_place / len(truth)
        if number == truth:
            score += 0.15
    return round(min(score, 0.9), 6)


def reward_function_path() -> str:
    """This module's file, absolute: the file-path form of reward.custom_reward_function.path."""
    return str(Path(__file__).resolve())
