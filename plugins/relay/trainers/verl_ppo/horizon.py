"""The LR schedule's horizon across chunks, and what of verl's internals keeps it.

verl has no "stop at step E" setting. Setting trainer.total_training_steps to a chunk's end would
stop the loop there, but verl also copies it into actor.optim.total_training_steps, the LR
schedule's horizon: a cosine schedule or a ratio-based warmup would then change with every chunk.
Relay keeps total_training_steps at the run's total and lowers only the loop bound
(`loop_bound`, chunk_trainer.RelayChunkTrainer). That relies on a few facts of verl's source, which
`loop_bound_problems()` checks in the installed verl (relay.trainers.verl_ppo.verl_contract) before any job
trains:

- the v1 TaskRunner looks its trainer class up by trainer.v1.trainer_mode in TRAINER_REGISTRY;
- PPOTrainer._init_dataloader sets self.total_training_steps and writes the optimizer horizon;
- PPOTrainer._setup builds the workers (and so the LR schedulers) after _init_dataloader;
- PPOTrainer.fit loops while global_steps <= self.total_training_steps and treats the step that
  reaches it as the last (save, validate).

When the loop-bound facts do not hold, the only safe way to end a chunk is verl's own
total_training_steps = the chunk's end (`total_steps`), which is exact only for a schedule whose LR
does not depend on the horizon (constant, with an absolute warmup). A horizon-dependent schedule
(cosine, warmup ratio) is then refused in chunks, with an error; it is never run wrong silently.
"""

from __future__ import annotations

import functools

from relay.common.errors import RelayError

LOOP_BOUND = "loop_bound"  # total_training_steps = the run's total; the subclass lowers only the loop bound
TOTAL_STEPS = "total_steps"  # total_training_steps = the chunk's end (horizon-independent schedules only)


class HorizonError(RelayError):
    """A chunk cannot keep the run's LR-schedule horizon: refused before any GPU time."""

    exit_code = 2
    retry_helps = False


def warmup_steps(optim, horizon: int) -> int:
    """verl's warmup (FSDPEngine._build_lr_scheduler): absolute if > 0, else ratio x horizon."""
    return optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else int(optim.lr_warmup_steps_ratio * horizon)


def describe_schedule(optim, horizon: int) -> str:
    s = f"{optim.lr_scheduler_type} (warmup {warmup_steps(optim, horizon)} steps"
    return s + (f", horizon {horizon} steps)" if optim.horizon_dependent else ")")


# ------------------------------------------------------------------------------ verl's contract


def loop_bound_problems() -> list[str]:
    """The loop-bound facts above, as verl_contract checks them (empty: the horizon is guaranteed). Read once per
    process, from the source verl was imported with."""
    return list(_loop_bound_problems())


@functools.lru_cache(maxsize=1)
def _loop_bound_problems() -> tuple[str, ...]:
    from relay.trainers.verl_ppo import verl_contract

    return tuple(verl_contract.problems(names=verl_contract.LOOP_BOUND_FACTS))


def chunk_strategy(spec, problems: list[str] | None = None) -> str:
    """How this spec's chunks end: LOOP_BOUND when verl's source keeps the horizon, else TOTAL_STEPS for a
    horizon-independent schedule. A horizon-dependent schedule in several chunks is refused then."""
    problems = loop_bound_problems() if problems is None else problems
    if not problems:
        return LOOP_BOUND
    s = spec.settings
    chunks = -(-spec.total_steps // spec.chunk_steps)
    if s.mode == "chunked" and chunks > 1 and s.optim.horizon_dependent:
        from importlib.metadata import version

        raise HorizonError(
            f"verl {version('verl')}'s trainer no longer matches what Relay relies on to keep the LR schedule's "
            f"horizon at the run's {spec.total_steps} steps while a chunk stops early: "
            + "; ".join(problems)
            + f". The schedule {describe_schedule(s.optim, spec.total_steps)} depends on the horizon, so running "
            "it in chunks would quietly change the LR; refused",
            "use mode: supervised (one job to the end, no loop change), or a horizon-independent schedule "
            "(lr_scheduler_type: constant with an absolute lr_warmup_steps), or the verl version Relay's contract "
            "tests pin (0.9.1)",
        )
    return TOTAL_STEPS
