"""The production trainer: verl's main_ppo (v1 sync or colocate_async trainer, FSDP/FSDP2, vLLM or SGLang) on a GPU
Ray cluster.

settings (pydantic only), overrides (Hydra overrides from the spec; compose verl's own config),
horizon (the LR horizon across chunks), verl_contract (every touch point of verl Relay relies on, and its check),
chunk_trainer (verl's trainer that stops at a chunk's end), async_trainer (the async mode's exact resume), runner
(verl's TaskRunner with the trainer installed in the actor), hygiene (before a resume), tracking (one tracking run
per training run), trainer (the job's driver), supervised (one long job whose checkpoints the chunk tasks wait for).
The CPU platform's stand-ins (verl's `cpu` platform, its patches, the hf rollout, the gloo checkpoint engine, the
tiny model and task) are in relay.trainers.verl_ppo.cpu, which the production path never imports.
Only settings, tracking and supervised are imported on the Airflow side; nothing here imports verl, torch or ray
at module level, except chunk_trainer and async_trainer, which only verl's TaskRunner actor imports.
"""
