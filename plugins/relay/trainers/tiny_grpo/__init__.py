"""The CPU GRPO trainer: settings, task and trainer."""
