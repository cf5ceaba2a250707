"""The kind: what it can do (chunks in-process, no warm handoff, no certificates, no reshard) and its parts."""

from relay.spec.kinds import TrainerKind

KIND = TrainerKind(
    name="line_fit",
    settings="line_fit.settings:LineFitSettings",
    train_chunk="line_fit.trainer:train_chunk",
    description="a line fitted to single-digit sums by SGD (a team's own kind)",
    resolved="line_fit.trainer:resolved_settings",
)
