"""The production trainer: verl's main_ppo (v1 sync or colocate_async trainer, FSDP/FSDP2, vLLM or SGLang) on a GPU
Ray cluster.

settings (pydantic only), overrides (Hydra overrides from the spec; compose verl's own config),
horizon (the LR horizon across chunks; verl's contract), chunk_trainer (verl's trainer that stops at a
chunk's end), async_trainer (the async mode's exact resume), runner (verl's TaskRunner with the trainer installed
in the actor), hygiene (before a resume), tracking (one tracking run per training run), trainer (the
job's driver), supervised (one long job whose checkpoints the chunk tasks wait for), tiny_model (a
few-layer Qwen2 with a byte-level tokenizer made here, for verl on a CPU), cpu_platform and cpu_device
(verl's `cpu` platform and its device module, imported by verl itself when a job asks for the platform).
Only settings, tracking and supervised are imported on the Airflow side; nothing here imports verl,
torch or ray at module level, except cpu_platform and cpu_device, which only a verl process imports.
"""
