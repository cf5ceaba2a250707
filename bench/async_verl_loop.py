"""verl's own loop, the baseline of bench/async.py: the driver of a Ray job that runs verl's main_ppo (TaskRunnerV1,
PPOTrainerSeparateAsync, verl's own ReplayBufferAsync) on the config Relay composes for the spec, less Relay's
hooks (its chunk trainer, checkpoint callback and sampler) and less saves. Everything else is the same: the hf
stand-in engine and its timing, the staleness bound and `wait`, the batch sizes, the CPU platform.

python async_verl_loop.py SPEC RUN_DIR STEPS (bench/async.py submits it with Relay's code as a py_module)
"""

from __future__ import annotations

import sys
from pathlib import Path

from relay.runs.run import Run
from relay.spec.run_spec import load_spec
from relay.trainers.verl_ppo import overrides
from relay.trainers.verl_ppo.cpu.tiny_model import ensure_tiny_model

RELAYS = ("trainer.checkpoint_callback_class=", "trainer.v1.sampler.custom_sampler.", "trainer.save_freq=")


def main(spec_path: str, run_dir: str, steps: int) -> None:
    spec = load_spec(spec_path, check_environment=False)
    if spec.settings.tiny_model:
        ensure_tiny_model(spec.settings.model_path)
    run = Run(spec, Path(run_dir).name, Path(run_dir), None)
    data = {"train": list(spec.data.train_files), "val": list(spec.data.val_files)}
    lines = overrides.chunk_overrides(run, first_step_of_run=True, data=data)
    lines = [line for line in lines if not line.startswith(RELAYS)] + ["trainer.save_freq=-1"]
    config = overrides.compose(lines)
    assert config.trainer.total_training_steps == steps, "the spec's total_steps is the benchmark's steps"
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    overrides.check_config(config)
    run_ppo(config, task_runner_class=TaskRunnerV1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
