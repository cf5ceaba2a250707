"""The CPU GRPO trainer as a trainer kind (registered in relay.spec.kinds): what it can do, where its parts are."""

from relay.spec.kinds import TrainerKind

KIND = TrainerKind(
    name="tiny_grpo",
    settings="relay.trainers.tiny_grpo.settings:TinyGRPOSettings",
    train_chunk="relay.trainers.tiny_grpo.trainer:train_chunk",
    description="a small, real GRPO trainer on CPU built from verl's parts (demo and CI)",
    warm_handoff=True,
    async_save=True,
    smoke="relay.trainers.tiny_grpo.trainer:smoke",
    certify="relay.trainers.tiny_grpo.trainer:certify",
    resolved="relay.trainers.tiny_grpo.trainer:resolved_settings",
)
