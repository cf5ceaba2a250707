"""verl's own FSDP engine (FSDPEngineWithLMHead, FSDP2) on the cpu platform, in a gloo process of world size 1:

    python tests/support/verl_engine_cpu.py MODEL_DIR CKPT_DIR step|load PORT

`step` builds the engine on the model, takes one optimizer step through verl's optimizer_step (clip and
step) on a squared-logits loss, and saves through the engine's checkpoint manager; `load` builds a fresh
engine, loads that checkpoint and compares the weights. Prints one line `RESULT {json}`. The job's
environment (VERL_PLATFORM, VERL_USE_EXTERNAL_MODULES) comes from the caller."""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
model_dir, ckpt, mode = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ.update(
    {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[4]}
)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", rank=0, world_size=1)
import verl  # noqa: E402,F401  (imports VERL_USE_EXTERNAL_MODULES: the cpu platform)
from verl.trainer.config.config import CheckpointConfig  # noqa: E402
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402

engine = EngineRegistry.new(
    model_type="language_model",
    backend="fsdp2",
    model_config=HFModelConfig(
        path=model_dir, use_remove_padding=False, override_config={"attn_implementation": "sdpa"}
    ),  # verl's default: flash_attention_2
    engine_config=FSDPEngineConfig(strategy="fsdp2"),
    optimizer_config=FSDPOptimizerConfig(lr=1e-2, total_training_steps=4),
    checkpoint_config=CheckpointConfig(),
)
engine.initialize()


def weights() -> dict:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in engine.module.state_dict().items()
    }


out = {"engine": type(engine).__name__, "device": str(next(engine.module.parameters()).device)}
if mode == "step":
    before = weights()
    torch.manual_seed(0)
    engine.optimizer_zero_grad()
    ids = torch.randint(0, 256, (2, 8))
    engine.module(input_ids=ids).logits.float().pow(2).mean().backward()
    out["grad_norm"] = float(engine.optimizer_step())
    out["lr"] = engine.optimizer.param_groups[0]["lr"]
    after = weights()
    out["moved"] = sorted(k for k in before if not torch.equal(before[k], after[k]))[:3]
    engine.save_checkpoint(ckpt, global_step=1)
    torch.save(after, os.path.join(os.path.dirname(ckpt), "expected.pt"))
else:
    engine.load_checkpoint(ckpt)
    expected = torch.load(os.path.join(os.path.dirname(ckpt), "expected.pt"))
    got = weights()
    out["equal"] = all(torch.equal(expected[k], got[k]) for k in expected)
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
