"""Learning-rate schedules, stepped once per optimizer step.

A schedule factory is called as ``factory(optimizer, run_steps=N)``: ``N`` is the run's optimizer steps
(``trainer.estimated_stepping_batches``: epochs x batches per epoch / accumulation, or ``max_steps``), so a
schedule fits the run whatever its device count, epochs or data size.
"""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from project.options.errors import ConfigError
from project.options.option_types import Fraction, NonNegativeInt, PositiveInt


def warmup_steps_of(run_steps: int, warmup_steps: int | None, warmup_fraction: float | None) -> int:
    """Warmup length in optimizer steps: given directly, or as a fraction of the run (at most one of the two)."""
    if warmup_steps is not None and warmup_fraction is not None:
        raise ConfigError(
            "model.scheduler.warmup_fraction",
            f"is {warmup_fraction} while model.scheduler.warmup_steps is {warmup_steps}: the warmup is one or the "
            "other.",
            "set one of them to null.",
        )
    if warmup_fraction is not None:
        return round(warmup_fraction * run_steps)
    return warmup_steps or 0


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    run_steps: int,
    warmup_steps: NonNegativeInt | None = None,
    warmup_fraction: Fraction | None = None,
    total_steps: PositiveInt | None = None,
    min_lr_ratio: Fraction = 0.1,
) -> LambdaLR:
    """Linear warmup from 0 to the optimizer's lr, then cosine decay to ``min_lr_ratio`` x lr at ``total_steps``
    (default: the end of the run; flat after it).

    Optimizer step ``s`` (from 0) runs at lr x ``(s + 1) / W`` during the ``W`` warmup steps, then at
    lr x ``(m + (1 - m) (1 + cos(pi p)) / 2)`` with ``p = (s - W) / (T - W)`` capped at 1.
    """
    warmup = warmup_steps_of(run_steps, warmup_steps, warmup_fraction)
    total = run_steps if total_steps is None else total_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def warmup_linear(
    optimizer: torch.optim.Optimizer,
    run_steps: int,
    warmup_steps: NonNegativeInt | None = None,
    warmup_fraction: Fraction | None = None,
    total_steps: PositiveInt | None = None,
    min_lr_ratio: Fraction = 0.0,
) -> LambdaLR:
    """Hugging Face's ``get_linear_schedule_with_warmup`` (TRL's default, ``lr_scheduler_type="linear"``) at
    ``min_lr_ratio`` 0: linear warmup from 0 over ``W`` steps, then linear decay to ``min_lr_ratio`` x lr at
    ``total_steps`` (default: the end of the run; flat after it).

    Optimizer step ``s`` (from 0) runs at lr x ``s / W`` during the warmup, then at lr x
    ``(m + (1 - m) max(0, (T - s) / (T - W)))``.
    """
    warmup = warmup_steps_of(run_steps, warmup_steps, warmup_fraction)
    total = run_steps if total_steps is None else total_steps

    def factor(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return min_lr_ratio + (1 - min_lr_ratio) * max(0.0, (total - step) / max(1, total - warmup))

    return LambdaLR(optimizer, factor)
