"""Preference tuning: DPO (Rafailov et al., 2023) and IPO (Azar et al., 2023) on preference pairs
(``experiment=dpo``, ``data=preference``), with TRL's loss and its metric names.

A pair's log-probability under a model is the sum of its response tokens' log-probabilities (the targets not
``IGNORE_INDEX``). With the policy's (``pi``) and the reference's (``ref``) log-probabilities of the chosen (``c``)
and rejected (``r``) responses, and ``delta = (pi_c - ref_c) - (pi_r - ref_r)``:

- ``sigmoid`` (DPO): ``-log sigmoid(beta * delta)``;
- ``ipo``: ``(delta' - 1 / (2 beta))^2``, ``delta'`` with each response's log-ratio divided by its token count (TRL's
  normalisation, which the IPO authors confirmed).

The loss is the batch's mean over pairs; rewards are ``beta x`` the log-ratios (``rewards/chosen``,
``rewards/rejected``, their difference ``rewards/margins``, and ``rewards/accuracies``: the share of pairs whose
chosen reward is the larger), means over pairs per epoch.

The reference is the model before its first step: the frozen base under LoRA (its adapters start at zero), the
initial weights with full fine-tuning. Its log-probabilities of every pair are the task's precomputation
(``project.job.task.Precomputation``): computed once, when training starts, by the same net under the same layout
(each data-parallel replica its share, then gathered), and kept in the checkpoints: so no second copy of the model is
held, and a step runs the policy's forward and backward alone (TRL's ``precompute_ref_log_probs``). So that the
policy before its first step is its reference, nothing in the training forward may differ from the evaluation one:
dropout and an expert capacity are refused (TRL turns dropout off, ``disable_dropout``).
"""

from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn import functional as F

from project.checkpointing.files import checkpoint_meta
from project.data.datamodule import DataModule, split_index_column
from project.data.preference import PreferenceDataModule
from project.data.targets import IGNORE_INDEX
from project.job.task import Loss, MetricSums, Precomputation
from project.models.lora import LoRALinear
from project.models.moe import Experts
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.options.option_types import NonNegativeFloat, PositiveFloat
from project.tasks.language_model import LanguageModelModule
from project.tasks.metrics import SampleMean

PAIR_METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
REFERENCE_KEY = "reference_log_probs"  # the checkpoint's entries: the values, and the fingerprint of their pairs
REFERENCE = Precomputation("DPO", "reference", "log-probabilities", "pair", REFERENCE_KEY, "reference_pairs")


@dataclass(frozen=True)
class PreferenceLoss:
    """``model.dpo``: ``beta``, how far the policy may move from the reference (DPO's beta, IPO's tau), the
    ``loss_type``, ``sigmoid`` (DPO) or ``ipo``, and ``sft_weight``, the weight of the chosen response's negative
    log-likelihood per token added to each pair's loss (RPO, Pang et al. 2024; Llama 3 used 0.2): it keeps the
    chosen responses likely, where DPO alone can widen the margin by making both less so."""

    beta: PositiveFloat = 0.1
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    sft_weight: NonNegativeFloat = 0.0

    def __call__(
        self, policy: torch.Tensor, reference: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's loss (pairs,) and its rewards (pairs, 2: chosen, rejected), from the log-probabilities of the
        policy and the reference and the responses' token counts, each (pairs, 2)."""
        ratios = policy - reference
        if self.loss_type == "sigmoid":
            losses = -F.logsigmoid(self.beta * (ratios[:, 0] - ratios[:, 1]))
        else:
            per_token = ratios / tokens.clamp(min=1)
            losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * self.beta)) ** 2
        if self.sft_weight:
            losses = losses - self.sft_weight * policy[:, 0] / tokens[:, 0].clamp(min=1)
        return losses, self.beta * ratios.detach()


class SequenceLogProbs(nn.Module):
    """Each row's log-probability: the log-softmax of its logits at its targets, summed over the targets that are
    not ``IGNORE_INDEX``. Logits split by vocabulary (tensor parallelism) go through torch's ``loss_parallel``, as
    ``TokenCrossEntropy`` does (its backward inside ``loss_parallel`` too: the strategy's)."""

    def __init__(self) -> None:
        super().__init__()
        self.summed = summed_log_probs

    def compile_summed(self) -> None:
        """``torch.compile`` it for plain logits (``model.compile``): no float32 copy of the logits kept."""
        self.summed = torch.compile(summed_log_probs)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if isinstance(logits, DTensor):
            with loss_parallel():
                # The per-token losses of split logits are a replicated DTensor (typed as a plain Tensor by torch).
                per_token = cast(DTensor, F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none"))
                return -per_token.to_local().float().view(target.shape).sum(-1)
        return self.summed(logits, target)


def summed_log_probs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(rows, length, vocab) logits, (rows, length) targets: (rows,) log-probabilities of the targets (ignored: 0),
    summed in float32: a sum of hundreds of log-probabilities in bfloat16 (``bf16-true``) would be off by whole nats,
    and DPO takes differences of such sums."""
    per_token = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
    return -per_token.float().view(target.shape).sum(-1)


class DPOModule(LanguageModelModule):
    """The language model trained on preference pairs (module docstring). Batches are a language model's (rows,
    length) inputs and targets, rows ``2i`` and ``2i + 1`` a pair's chosen and rejected sequences, the targets' last
    column each row's pair index (``project.data.preference``), which keys the reference's log-probabilities
    (``precomputed``: (pairs, 2), every pair's, training and validation, once training has started or a checkpoint
    has been read)."""

    criterion: SequenceLogProbs  # type: ignore[assignment]  # log-probabilities, not the token loss
    progress_bar_metrics = ("loss", "rewards/accuracies", "rewards/margins")
    logs_perplexity = False  # the loss is not a token loss
    sequences_per_sample = 2  # a pair: its chosen and rejected rows
    precomputation = REFERENCE

    def __init__(self, net: BlockSequence, dpo: PreferenceLoss, **kwargs) -> None:
        super().__init__(net, **kwargs)
        if self.fused_loss:  # a pair's loss needs each sequence's log-probability
            raise ConfigError(
                "model.fused_loss",
                "is true, but DPO needs each sequence's log-probability, and the fused loss sums every token.",
                "set model.fused_loss=false.",
            )
        self.dpo = dpo
        self.criterion = SequenceLogProbs()
        self.train_metrics = nn.ModuleDict({name: SampleMean() for name in PAIR_METRICS})
        self.val_metrics = nn.ModuleDict({name: SampleMean() for name in PAIR_METRICS})
        _check_same_in_training(net)

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> Loss:
        """The mean of the pairs' losses (whole pairs: a pipeline cuts a batch into micro-batches of whole samples);
        their rewards and the policy's log-probabilities are the metrics."""
        target, pairs = split_index_column(target)
        policy = self.criterion(outputs, target).view(-1, 2)
        tokens = (target != IGNORE_INDEX).sum(-1).view(-1, 2)
        losses, rewards = self.dpo(policy, self.precomputed_of(pairs[::2], outputs.device), tokens)

        def metric_sums() -> MetricSums:
            values = {
                "loss": losses.detach(),
                "rewards/chosen": rewards[:, 0],
                "rewards/rejected": rewards[:, 1],
                "rewards/margins": rewards[:, 0] - rewards[:, 1],
                "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float(),
                "logps/chosen": policy[:, 0].detach(),
                "logps/rejected": policy[:, 1].detach(),
            }
            return {name: (value.sum(), len(losses)) for name, value in values.items()}

        return Loss(losses.mean(), metric_sums)

    def data_problem(self, data: DataModule, ckpt_path: str | None, evaluating: bool) -> ConfigError | None:
        """DPO trains on preference pairs; a DPO checkpoint's reference serves its own pairs alone, and is what
        mode=eval compares the policy with."""
        if not isinstance(data, PreferenceDataModule):
            return ConfigError(
                "data",
                f"is {type(data).__name__}, but experiment=dpo trains on preference pairs.",
                "use data=preference data.path=<a .jsonl of prompt, chosen and rejected> (experiment=dpo sets it).",
            )
        problem = super().data_problem(data, ckpt_path, evaluating)
        if problem is None and evaluating and (ckpt_path is None or REFERENCE_KEY not in checkpoint_meta(ckpt_path)):
            given = "is null" if ckpt_path is None else f"is {ckpt_path}, not a DPO run's checkpoint"
            return ConfigError(
                "ckpt_path",
                f"{given}, but mode=eval of DPO compares the model with its reference, whose log-probabilities a DPO "
                "run's checkpoints hold: without them the model would be its own reference (every reward 0, the loss "
                "log 2).",
                "pass ckpt_path=<a DPO run's checkpoints/last.ckpt>, with that run's data.",
            )
        return problem


def _check_same_in_training(net: nn.Module) -> None:
    """Refuse what makes the net's training forward differ from its evaluation one: the policy, before its first
    step, would differ from its reference (computed in evaluation), and DPO would chase noise."""
    for name, module in net.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            owner = net.get_submodule(name.rpartition(".")[0])
            key = "model.lora.dropout" if isinstance(owner, LoRALinear) else "model.net.dropout"
            raise ConfigError(
                key,
                f"is {module.p}, but DPO's reference is the model before its first step, computed without dropout: "
                "with it, the policy differs from its reference before any step.",
                f"set {key}=0 (TRL's DPO turns dropout off too).",
            )
        if isinstance(module, Experts) and module.capacity_factor is not None:
            raise ConfigError(
                "model.net.capacity_factor",
                f"is {module.capacity_factor}: in training an expert drops the assignments past its capacity, but "
                "DPO's reference, the model before its first step, is computed in evaluation, which drops none.",
                "set model.net.capacity_factor=null.",
            )
