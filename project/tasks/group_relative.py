"""GRPO's arithmetic (Shao et al. 2024; Dr. GRPO, Liu et al. 2025; DAPO, Yu et al. 2025), as TRL's ``GRPOTrainer``
computes it (TRL 1.16, ``num_iterations=1``: each batch of completions trains one step, on-policy).

A prompt's ``num_generations`` completions are its group. A completion's reward is the weighted sum of the reward
functions' scores (a function may leave a completion unscored: NaN here, TRL's ``None``; a completion none scored is
left out of its group's statistics and gets no advantage). Its advantage is its reward less its group's mean, divided
by the standard deviation (Bessel's) of its group's rewards (``scale_rewards="group"``), of the whole step's
(``"batch"``), or not divided (``"none"``; Dr. GRPO), plus 1e-4.

Per completion token, with ``r = exp(logp - logp_old)`` (1 on-policy; its gradient is ``logp``'s) and the advantage
``A``: ``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)``, plus ``beta`` times the KL estimate
``exp(ref - logp) - (ref - logp) - 1`` (times ``r``: TRL's ``use_bias_correction_kl``). The step's loss is
(``loss_type``): ``grpo``, each completion's mean over its tokens, then the mean over completions; ``dr_grpo``, the sum
over every token divided by the completions times ``max_completion_length``; ``dapo`` (TRL's default), the sum over
every token of the step divided by the step's tokens (over every data-parallel rank: a rank divides its sum by the
step's tokens over the ranks, data parallelism's mean of the ranks' gradients then makes the whole step's).

``logp`` is the log-probability of a completion token under the policy's logits divided by the sampling
``temperature``, as the completion was drawn (TRL scales them the same).
"""

from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn import functional as F

from project.data.targets import IGNORE_INDEX

ADVANTAGE_EPSILON = 1e-4  # TRL's: a group whose rewards are all equal divides 0 by it, not by 0


def nan_std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation with Bessel's correction of the non-NaN ``values`` (over ``dim``, or all): NaN where
    fewer than two."""
    present = ~values.isnan()
    count = present.sum(dim) if dim is not None else present.sum()
    mean = values.nanmean(dim, keepdim=True) if dim is not None else values.nanmean()
    squares = torch.where(present, (values - mean) ** 2, 0.0)
    summed = squares.sum(dim) if dim is not None else squares.sum()
    return torch.where(count > 1, (summed / (count - 1).clamp(min=1)).sqrt(), torch.nan)


def completion_rewards(scores: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(completions, functions) scores (NaN: unscored) -> (completions,) rewards, each the weighted sum of its
    scores, NaN where no function scored it."""
    rewards = (scores * weights).nansum(-1)
    return torch.where(scores.isnan().all(-1), torch.nan, rewards)


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage (module docstring), of ``rewards`` (completions,) of whole groups one after
    another, NaN for the unscored; and whether the standard deviation that scaled it is 0 (TRL's
    ``frac_reward_zero_std`` counts them)."""
    grouped = rewards.view(-1, num_generations)
    centred = (grouped - grouped.nanmean(1, keepdim=True)).flatten()
    if scale_rewards == "batch":
        std = nan_std(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nan_std(grouped, 1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = centred if scale_rewards == "none" else centred / (std + ADVANTAGE_EPSILON)
    return advantages.nan_to_num(0.0), torch.isclose(std, torch.zeros_like(std))


@dataclass(frozen=True)
class TokenTerms:
    """A batch's per-token terms the metrics read, each (completions, tokens) and 0 off the completions' tokens."""

    kl: torch.Tensor | None  # the KL estimate to the reference, where beta > 0
    low_clipped: torch.Tensor  # the ratio below 1 - epsilon with a negative advantage (the clip binds)
    high_clipped: torch.Tensor  # above 1 + epsilon_high with a positive advantage


@dataclass(frozen=True)
class PolicyLoss:
    """The clipped surrogate and its normalisation (module docstring): ``epsilon``, ``epsilon_high`` (None: epsilon;
    DAPO's clip-higher sets it apart), ``beta`` (the KL term's weight; 0: no reference), ``loss_type`` and
    ``max_completion_length`` (``dr_grpo``'s constant)."""

    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "dapo"
    max_completion_length: int = 256

    def __call__(
        self,
        log_probs: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        reference: torch.Tensor | None = None,
        step_tokens_per_rank: torch.Tensor | float | None = None,
    ) -> tuple[torch.Tensor, TokenTerms]:
        """The loss of a batch: ``log_probs`` (completions, tokens) of the completions' tokens under the policy,
        ``mask`` (1 on a completion's tokens), ``advantages`` (completions,), ``reference``'s log-probabilities where
        beta > 0, and for ``dapo`` the step's completion tokens over every rank divided by the ranks."""
        mask = mask.to(log_probs.dtype)
        ratio = torch.exp(log_probs - log_probs.detach())  # on-policy: 1, with the gradient of log_probs
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        advantage = advantages[:, None]
        per_token = -torch.min(ratio * advantage, ratio.clamp(1 - self.epsilon, 1 + high) * advantage)
        kl = None
        if self.beta:
            assert reference is not None, "beta > 0 needs the reference's log-probabilities"
            gap = reference - log_probs
            kl = (torch.exp(gap) - gap - 1) * ratio
            per_token = per_token + self.beta * kl
        masked = per_token * mask
        if self.loss_type == "grpo":
            loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1)).mean()
        elif self.loss_type == "dr_grpo":
            loss = masked.sum() / (len(masked) * self.max_completion_length)
        else:
            assert step_tokens_per_rank is not None, "dapo divides by the step's tokens"
            loss = masked.sum() / torch.as_tensor(step_tokens_per_rank).clamp(min=1)
        terms = TokenTerms(
            kl=None if kl is None else kl.detach() * mask,
            low_clipped=((ratio < 1 - self.epsilon) & (advantage < 0)).to(mask.dtype) * mask,
            high_clipped=((ratio > 1 + high) & (advantage > 0)).to(mask.dtype) * mask,
        )
        return loss, terms


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy in nats of each position's distribution, (..., vocab) logits -> (...), without a gradient."""
    with torch.no_grad():
        log_p = logits.float().log_softmax(-1)
        return -(log_p.exp() * log_p).sum(-1)


def token_log_probs(logits: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    """(rows, length) log-probabilities of ``target`` under ``logits`` (rows, length, vocab) divided by
    ``temperature``, in float32; 0 where the target is ``IGNORE_INDEX``."""
    scaled = (logits / temperature).flatten(0, 1)
    per_token = F.cross_entropy(scaled.float(), target.flatten(), reduction="none", ignore_index=IGNORE_INDEX)
    return -per_token.view(target.shape)
