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
initial weights with full fine-tuning. Its log-probabilities of every pair are computed once, when training starts,
by the same net under the same layout (each data-parallel replica its share, then gathered), and kept in the
checkpoints: so no second copy of the model is held, and a step runs the policy's forward and backward alone
(TRL's ``precompute_ref_log_probs``). So that the policy before its first step is its reference, nothing in the
training forward may differ from the evaluation one: dropout and an expert capacity are refused (TRL turns dropout
off, ``disable_dropout``).
"""

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn import functional as F

from project.data.sampling import data_parallel_rank_and_size
from project.job.job import Job
from project.models.linear_cross_entropy import IGNORE_INDEX
from project.models.lora import LoRALinear
from project.models.moe import Experts
from project.options.errors import ConfigError
from project.options.option_types import NonNegativeFloat, PositiveFloat
from project.strategies.laid_out import LaidOutStrategy
from project.tasks.language_model import LanguageModelModule
from project.tasks.metrics import SampleMean

if TYPE_CHECKING:  # the data module imports nothing of this one; the checks build both
    from project.data.preference import PreferenceDataModule

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
PAIRS_KEY = "reference_pairs"


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
    length) inputs and targets, rows ``2i`` and ``2i + 1`` a pair's chosen and rejected sequences, and the pairs'
    indices (``project.data.preference``), which key ``reference_log_probs``: (pairs, 2), every pair's, training and
    validation, once training has started or a checkpoint has been read."""

    criterion: SequenceLogProbs  # type: ignore[assignment]  # log-probabilities, not the token loss
    progress_bar_metrics = ("loss", "rewards/accuracies", "rewards/margins")
    logs_perplexity = False  # the loss is not a token loss

    def __init__(self, net: nn.Module, dpo: PreferenceLoss, **kwargs) -> None:
        super().__init__(net, **kwargs)  # type: ignore[arg-type]
        self.dpo = dpo
        self.criterion = SequenceLogProbs()
        self.train_metrics = nn.ModuleDict({name: SampleMean() for name in PAIR_METRICS})
        self.val_metrics = nn.ModuleDict({name: SampleMean() for name in PAIR_METRICS})
        self.reference_log_probs: torch.Tensor | None = None
        _check_same_in_training(net)

    def loss_problem(self, job: Job) -> ConfigError | None:
        """A pair's loss needs each sequence's log-probability: not the fused loss, which sums every token."""
        if self.fused_loss:
            return ConfigError(
                "model.fused_loss",
                "is true, but DPO needs each sequence's log-probability, and the fused loss sums every token.",
                "set model.fused_loss=false.",
            )
        return None

    @classmethod
    def samples_forward_before_training(cls, train_samples: int, val_samples: int) -> int:
        """Every pair, training and validation: the reference's log-probabilities."""
        return train_samples + val_samples

    def pair_losses(
        self, logits: torch.Tensor, target: torch.Tensor, reference: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pairs' losses and rewards, and the policy's log-probabilities (each pairs x 2)."""
        policy = self.criterion(logits, target).view(-1, 2)
        tokens = (target != IGNORE_INDEX).sum(-1).view(-1, 2)
        losses, rewards = self.dpo(policy, reference, tokens)
        return losses, rewards, policy

    def outputs_and_loss(
        self, net: nn.Module, inputs: torch.Tensor, target: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The memory plan's simulated step: a training step's work, against a stand-in reference (zeros: its values
        change no shape, byte or FLOP of the step)."""
        reference = torch.zeros(len(inputs) // 2, 2, device=inputs.device)
        return None, self.pair_losses(net(inputs), target, reference)[0].mean()

    def batch_loss(self, split: str, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The mean of the batch's pairs' losses, their rewards and log-probabilities added to ``split``'s metrics."""
        inputs, target, pairs = batch
        loss = self.metered_pair_loss(split, self.net(inputs), target, pairs)
        self.log_metrics(split)
        return loss

    def schedule_batch(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The targets with each row's pair index as one more column: the schedule keeps it with its row."""
        inputs, target, pairs = batch
        return inputs, torch.cat([target, pairs.repeat_interleave(2)[:, None]], dim=1)

    def microbatch_loss(self, split: str, outputs: torch.Tensor, target: torch.Tensor, metered: bool) -> torch.Tensor:
        """A micro-batch's pairs (whole: the pipeline cuts a batch into micro-batches of whole samples)."""
        target, pairs = target[:, :-1], target[::2, -1]
        if metered:
            return self.metered_pair_loss(split, outputs, target, pairs)
        return self.pair_losses(outputs, target, self._reference_of(pairs, outputs.device))[0].mean()

    def _reference_of(self, pairs: torch.Tensor, device: torch.device) -> torch.Tensor:
        assert self.reference_log_probs is not None, "computed when training starts, or read from the checkpoint"
        return self.reference_log_probs[pairs.to(self.reference_log_probs.device)].to(device)

    def metered_pair_loss(
        self, split: str, logits: torch.Tensor, target: torch.Tensor, pairs: torch.Tensor
    ) -> torch.Tensor:
        """The mean of the pairs' losses, their rewards and log-probabilities added to ``split``'s metrics."""
        losses, rewards, policy = self.pair_losses(logits, target, self._reference_of(pairs, logits.device))
        loss = losses.mean()
        values = {
            "loss": losses.detach(),
            "rewards/chosen": rewards[:, 0],
            "rewards/rejected": rewards[:, 1],
            "rewards/margins": rewards[:, 0] - rewards[:, 1],
            "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float(),
            "logps/chosen": policy[:, 0].detach(),
            "logps/rejected": policy[:, 1].detach(),
        }
        metrics = self.metrics_for(split)
        count = torch.tensor(len(losses), device=loss.device)
        for name, value in values.items():
            cast(SampleMean, metrics[name]).add(value.sum(), count)
        if split == "train" and self.trainer.log_every_n_steps:  # type: ignore[attr-defined]
            self.interval_loss.add(losses.detach().sum(), count)
        return loss

    # At the first of the sanity check's validation and training (mode=eval reads it from the checkpoint): after
    # Lightning has read a checkpoint, which sharded strategies do only after on_fit_start.
    def on_train_start(self) -> None:
        self._reference_ready()

    def on_validation_start(self) -> None:
        self._reference_ready()

    def _reference_ready(self) -> None:
        """The reference's log-probabilities on this rank's device: those the checkpoint held, or else computed now."""
        if self.reference_log_probs is not None:  # read from a checkpoint (whose net is no longer the reference)
            self.reference_log_probs = self.reference_log_probs.to(self.device)
            return
        start = time.perf_counter()
        # Outside the inference mode Lightning validates in: the values serve training steps too.
        with torch.inference_mode(False):
            self.reference_log_probs = self._reference_log_probs()
        rank_zero_info(
            f"DPO reference: the log-probabilities of all {len(self.reference_log_probs)} pairs under the model "
            f"before its first step, computed in {time.perf_counter() - start:.1f} s (kept in the checkpoints)."
        )

    def _reference_log_probs(self) -> torch.Tensor:
        """Every pair's log-probabilities under the net as it is, in evaluation mode: each data-parallel replica
        computes its share (every ``replicas``-th pair, the last rounds wrapping around, so that all replicas run
        the same number of forwards, as sharded and split layouts need), then every rank gathers them all."""
        data = self.trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector
        rank, replicas = data_parallel_rank_and_size(self.trainer)
        count = len(data.inputs)
        positions = torch.arange(math.ceil(count / replicas)) * replicas + rank  # past count: wrapped around
        share = positions % count
        values = []
        training = self.net.training
        self.net.eval()
        strategy = self.trainer.strategy
        with torch.no_grad(), self.trainer.precision_plugin.forward_context():
            for pairs in share.split(data.batch_size):
                inputs, target = (tensor[pairs].flatten(0, 1).to(self.device) for tensor in (data.inputs, data.targets))
                if isinstance(strategy, LaidOutStrategy):  # its layout runs the net (a pipeline: stage by stage)
                    log_probs = strategy.row_values(self.net, inputs, target, self.criterion)
                else:  # Lightning's own: the whole net on every rank
                    log_probs = self.criterion(self.net(inputs), target)
                values.append(log_probs.view(-1, 2).float())
        self.net.train(training)
        gathered, positions = _from_every_rank(torch.cat(values)), _from_every_rank(positions.to(self.device))
        kept = positions < count  # each pair once: the wrapped ones again are computed in other batches
        reference = torch.empty(count, 2, device=self.device)
        reference[positions[kept]] = gathered[kept]
        return reference

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        assert self.reference_log_probs is not None, "saved once training has started"
        checkpoint[REFERENCE_KEY] = self.reference_log_probs.cpu()
        checkpoint[PAIRS_KEY] = self.trainer.datamodule.fingerprint  # type: ignore[attr-defined]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get(REFERENCE_KEY)
        if saved is None:
            return
        problem = reference_problem(checkpoint, self.trainer.datamodule)  # type: ignore[attr-defined]  # Lightning's
        if problem is not None:  # checked before launch too; here for a checkpoint read by other means
            raise problem
        self.reference_log_probs = saved


def reference_problem(checkpoint: dict, data: "PreferenceDataModule") -> ConfigError | None:
    """Why ``checkpoint``'s reference log-probabilities (those of its ``PAIRS_KEY``'s pairs) cannot serve ``data``'s
    pairs, or None (they can, or it holds none)."""
    saved = checkpoint.get(REFERENCE_KEY)
    if saved is None or checkpoint.get(PAIRS_KEY) == data.fingerprint:
        return None
    return ConfigError(
        "data.path",
        f"holds other pairs than the checkpoint's reference log-probabilities were computed on ({len(saved)} "
        f"pairs then, {len(data.inputs)} now; the file, data.seq_length or data.tokenizer differ).",
        "resume or evaluate with the data the run started with; for other pairs, start a new run from the "
        "exported model.",
    )


def _from_every_rank(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` (of the same shape on each), concatenated in rank order: torch's ``all_gather`` (NCCL and
    gloo), not Lightning's, which goes through a deprecated autograd-aware collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


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
