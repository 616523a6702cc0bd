"""Learning-rate schedules, stepped once per optimizer step."""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1
) -> LambdaLR:
    """Linear warmup from 0 to the optimizer's lr over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x lr
    at ``total_steps`` (and flat after)."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
