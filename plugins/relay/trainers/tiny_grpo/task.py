"""The CPU trainer's task: single-digit addition ("3+4=" -> "7"), verifiable by a rule-based reward.

Data is a parquet file in verl's RL schema (data_source, prompt as a chat list, ability,
reward_model{style, ground_truth}, extra_info{split, index}), so the same data checks and the same
freeze apply as for a real run. The tokenizer is character-level and built locally: no download.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Regex, Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
VOCAB = {PAD: 0, BOS: 1, EOS: 2, **{str(d): 3 + d for d in range(10)}, "+": 13, "=": 14, "<unk>": 15}
ID_TO_TOKEN = {i: t for t, i in VOCAB.items()}
DATA_SOURCE = "relay/arith"


def encode_prompt(text: str) -> list[int]:
    return [VOCAB[BOS]] + [VOCAB.get(ch, VOCAB["<unk>"]) for ch in text]


def decode_response(ids: list[int]) -> str | None:
    """The response text up to EOS, or None when the response never ended (ran out of length)."""
    out: list[str] = []
    for i in ids:
        if i == VOCAB[EOS]:
            return "".join(out)
        out.append(ID_TO_TOKEN.get(i, "?") if i >= 3 else "?")
    return None


def reward(response: str | None, truth: str) -> float:
    """1.0 for the exact answer; partial credit for a well-formed number, its length and right digits."""
    if not response or not response.isdigit():
        return 0.0
    if response == truth:
        return 1.0
    score = 0.1 + (0.2 if len(response) == len(truth) else 0.0)
    a, b = response[::-1], truth[::-1]
    score += 0.5 * sum(1 for i in range(min(len(a), len(b))) if a[i] == b[i]) / len(b)
    return score


def custom_reward(path: str, name: str):
    """The spec's reward function (verl's custom_reward_function: path and name), loaded from its file."""
    import importlib.util

    from relay.common import project
    from relay.common.errors import SpecError

    file = Path(path) if Path(path).is_absolute() else project.root() / path
    if not file.is_file():
        raise SpecError(
            "trainer.settings",
            "custom_reward_function.path",
            f"{file} is not a file",
            "name a .py file that defines the reward function",
        )
    module_spec = importlib.util.spec_from_file_location(f"relay_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
    module_spec.loader.exec_module(module)  # type: ignore[union-attr]
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SpecError(
            "trainer.settings",
            "custom_reward_function.name",
            f"{file} defines no function {name!r}",
            "give the name of the function that scores a response",
        )
    return fn


def prompt_text(prompt) -> str:
    """verl's prompt is a chat list of {role, content} (or a plain string): take the last user turn."""
    if isinstance(prompt, str):
        return prompt
    return [m["content"] for m in prompt if m["role"] == "user"][-1]


def hf_tokenizer():
    """A transformers tokenizer for the same vocabulary, saved into checkpoints' huggingface/ folder."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token="<unk>")


def make_dataset(path: Path, rows: int, seed: int, split: str = "train") -> Path:
    """Write `rows` addition problems in verl's RL parquet schema (deterministic for a seed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    records = []
    for i in range(rows):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        records.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": split, "index": i},
            }
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def load_rows(files: list[str]) -> list[tuple[str, str]]:
    """(prompt text, ground truth) for every row of the parquet files, in file order."""
    import pyarrow.parquet as pq

    out = []
    for f in files:
        t = pq.read_table(f, columns=["prompt", "reward_model"]).to_pylist()
        out += [(prompt_text(r["prompt"]), str(r["reward_model"]["ground_truth"])) for r in t]
    return out
