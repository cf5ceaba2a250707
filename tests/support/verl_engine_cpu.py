"""verl's own FSDP engine (FSDPEngineWithLMHead, FSDP2) on the cpu platform, in a gloo process of world size 1:

    python tests/support/verl_engine_cpu.py MODEL_DIR CKPT_DIR PORT

It builds the engine on the model, takes one optimizer step through verl's optimizer_step (clip and step) on
a squared-logits loss, and saves through the engine's checkpoint manager; then it builds a fresh engine from
the model, loads that checkpoint and compares the weights (one interpreter: verl is imported once). Prints one
line `RESULT {json}`. The job's
environment (VERL_PLATFORM, VERL_USE_EXTERNAL_MODULES) comes from the caller."""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")
model_dir, ckpt = sys.argv[1], sys.argv[2]
os.environ.update(
    {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": sys.argv[3]}
)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", rank=0, world_size=1)
import verl  # noqa: E402,F401  (imports VERL_USE_EXTERNAL_MODULES: the cpu platform)
from verl.trainer.config.config import CheckpointConfig  # noqa: E402
from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402


def build():
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
    return engine


engine = build()


def weights(engine) -> dict:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in engine.module.state_dict().items()
    }


out = {"engine": type(engine).__name__, "device": str(next(engine.module.parameters()).device)}
before = weights(engine)
torch.manual_seed(0)
engine.optimizer_zero_grad()
ids = torch.randint(0, 256, (2, 8))
engine.module(input_ids=ids).logits.float().pow(2).mean().backward()
out["grad_norm"] = float(engine.optimizer_step())
out["lr"] = engine.optimizer.param_groups[0]["lr"]
after = weights(engine)
out["moved"] = sorted(k for k in before if not torch.equal(before[k], after[k]))[:3]
engine.save_checkpoint(ckpt, global_step=1)

fresh = build()  # a fresh engine, from the model's initial weights
out["fresh_engine"] = type(fresh).__name__
out["fresh_differs"] = not all(torch.equal(after[k], v) for k, v in weights(fresh).items())
fresh.load_checkpoint(ckpt)
got = weights(fresh)
out["equal"] = all(torch.equal(after[k], got[k]) for k in after)
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
