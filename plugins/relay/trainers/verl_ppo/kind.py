"""verl's main_ppo as a trainer kind (registered in relay.spec.kinds): what it can do, where its parts are."""

from relay.spec.kinds import TrainerKind

KIND = TrainerKind(
    name="verl_ppo",
    settings="relay.trainers.verl_ppo.settings:VerlPPOSettings",
    train_chunk="relay.trainers.verl_ppo.trainer:train_chunk",
    description="verl's main_ppo (v1 sync, colocate_async or separate_async trainer) on a GPU Ray cluster, one "
    "chunk per job or one supervised job",
    ray_job=True,
    warm_handoff=True,
    async_save=True,
    reshard=True,
    modes=("chunked", "supervised"),
    smoke="relay.trainers.verl_ppo.smoke:smoke",
    certify="relay.trainers.verl_ppo.smoke:certify",
    resolved="relay.trainers.verl_ppo.trainer:resolved_settings",
    job_env="relay.trainers.verl_ppo.trainer:job_env",
    warm_blocker="relay.trainers.verl_ppo.settings:warm_blocker",
    environment_check="relay.trainers.verl_ppo.attention:check",
    library_contract="relay.trainers.verl_ppo.verl_contract",
    whole_run="relay.trainers.verl_ppo.overrides:whole_run_view",
    tiny_model="relay.trainers.verl_ppo.cpu.tiny_model:make_tiny_model",
)
