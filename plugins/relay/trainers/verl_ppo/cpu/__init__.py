"""verl on CPUs: what stands in for a GPU cluster's parts, so that verl's own trainer runs on a laptop or in CI.

platform and device (verl's `cpu` platform and its device module, chosen by `VERL_PLATFORM=cpu`; verl imports
`platform` in every process through `VERL_USE_EXTERNAL_MODULES`), patches (the verl lines, and one torch-private
FSDP1 check, that cannot run on a CPU as they are), hf_rollout and hf_sampling (the `hf` rollout: transformers in
verl's workers, seeded by sample), gloo_checkpoint_engine (separate_async's weights over gloo), tiny_model and
tiny_task (a 2-layer Qwen2 made here, and two-number addition with its reward).

Nothing in the production path (relay.trainers.verl_ppo) imports these modules; a GPU job never does.
relay.trainers.verl_ppo.contract marks the touch points of verl that only this platform needs.
"""
