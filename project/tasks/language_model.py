"""Next-token prediction: token cross-entropy, perplexity, and the data's entropy floor next to the val loss."""

from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn import functional as F

from project.data.datamodule import trainer_data
from project.job.job import Job
from project.job.task import Loss
from project.models.gpt import LMHead
from project.models.linear_cross_entropy import LOGITS_PER_CHUNK
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.options.option_types import PositiveInt
from project.tasks.base import TrainingModule, loss_sums
from project.tasks.metrics import SampleMean


class TokenCrossEntropy(nn.Module):
    """Cross-entropy of a (batch, length, vocab) logits tensor: summed over the trained targets (``IGNORE_INDEX``
    marks the others: data=chat's prompts and padding), divided by the number of target positions.

    Divided by the positions, a number every batch, micro-batch and data-parallel replica of a step has alike, not by
    the trained targets, which vary between them: so the means of means that data parallelism, gradient accumulation
    and pipeline micro-batches take are the global batch's own sum over its positions, as a single-device loop
    computes it. With every target trained (pretraining data) it is the mean token loss; with masked targets, the
    gradient is the trained tokens' mean gradient times the step's trained share. The epoch metrics are the mean
    over trained tokens (``project.tasks.base.loss_sums``).

    Logits split by vocabulary across tensor-parallel ranks (a DTensor) stay split: torch's ``loss_parallel``
    combines the ranks' partial sums; the loss, the same on every rank, comes back as a plain tensor. Its backward
    must run inside ``loss_parallel`` too (the tensor-parallel strategies' ``backward``)."""

    def __init__(self) -> None:
        super().__init__()
        self.summed = summed_token_loss

    def compile_summed(self) -> None:
        """``torch.compile`` the loss of plain logits (torchtitan compiles its loss too): inductor reads the logits
        once in their dtype and keeps no float32 log-softmax, where eager writes a float32 copy and its
        log-softmax, and backward reads and writes both again. Split logits (tensor parallelism) stay eager."""
        self.summed = torch.compile(summed_token_loss)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if isinstance(logits, DTensor):
            with loss_parallel():
                # A DTensor's loss is a DTensor (typed as a plain Tensor by torch).
                total = cast(DTensor, summed_token_loss(logits, target))
                return total.to_local() / target.numel()
        return self.summed(logits, target) / target.numel()


def summed_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of (batch, length, vocab) logits summed over the targets (``IGNORE_INDEX`` left out)."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")


class LanguageModelModule(TrainingModule):
    """``net`` maps token ids (batch, length) to next-token logits. Logs ``train/loss``, ``val/loss`` and
    ``val/perplexity`` per epoch, and ``data/entropy_floor`` when the data knows its best achievable loss.

    ``fused_loss``: the net's head computes the loss from its hidden states a chunk of tokens at a time
    (``project.models.linear_cross_entropy``), so that the step never holds the (batch, length, vocab) logits, their
    float32 copy or their gradient; the same loss as ``TokenCrossEntropy`` of the logits; at most
    ``fused_loss_chunk_logits`` logits a chunk. For layouts whose ranks each run the whole model (``problem``)."""

    criterion: TokenCrossEntropy
    logs_perplexity = True  # val/perplexity, exp of val/loss: a subclass whose loss is no token loss says False

    def __init__(
        self,
        net: BlockSequence,
        fused_loss: bool = False,
        fused_loss_chunk_logits: PositiveInt = LOGITS_PER_CHUNK,
        **kwargs,
    ) -> None:
        super().__init__(net, **kwargs)
        self.fused_loss = fused_loss
        if fused_loss:
            cast(LMHead, net.head).logits_per_chunk = fused_loss_chunk_logits
        self.criterion = TokenCrossEntropy()
        self.train_metrics = nn.ModuleDict({"loss": SampleMean()})
        self.val_metrics = nn.ModuleDict({"loss": SampleMean()})

    def net_outputs(self, last: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The logits; with the fused loss, the head's summed token loss of ``target``."""
        return last(x, target) if self.fused_loss else last(x)

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> Loss:
        """The token cross-entropy (``TokenCrossEntropy``) of the logits, or of the fused loss's sum."""
        value = outputs / target.numel() if self.fused_loss else self.criterion(outputs, target)
        return Loss(value, lambda: loss_sums(value, target))

    def compile_loss(self) -> None:
        """The loss of the logits compiled whole, or the fused loss's work on each chunk."""
        if self.fused_loss:
            cast(LMHead, self.net.head).compiled_loss = True
        else:
            self.criterion.compile_summed()

    def compiled_loss_module(self) -> nn.Module | None:
        return self.net.head if self.fused_loss else self.criterion

    def problem(self, job: Job) -> ConfigError | None:
        """The fused loss takes the output layer's whole weight and the targets in the head, which a pipeline's last
        stage (its schedule hands the loss function the stage's output) and a tensor-parallel split of the
        vocabulary (``loss_parallel`` combines the ranks' logits) do not give it."""
        if self.fused_loss and not job.dims.runs_whole_model:
            return ConfigError(
                "model.fused_loss",
                f"is true under strategy={job.strategy_name}, whose ranks do not each run the whole model "
                "(pipeline stages, a tensor-parallel split of the output layer).",
                "set model.fused_loss=false (tensor parallelism splits the output layer by vocabulary already), or "
                "train with strategy=fsdp, ddp or model_parallel.",
            )
        return None

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        if not self.logs_perplexity:
            return
        # Perplexity is exp of the mean token loss, which the loss metric already holds (reduced over all ranks):
        # no second pass over the logits. It and the floor are the same on every rank: sync_dist's max keeps them,
        # where Lightning would warn about an epoch-level value not reduced.
        perplexity = torch.exp(cast(SampleMean, self.val_metrics["loss"]).compute())
        self.log("val/perplexity", perplexity, sync_dist=True, reduce_fx="max")
        floor = trainer_data(self.trainer).entropy_floor
        if floor is not None:  # plotted beside val/loss: how far the model is from the best possible
            self.log("data/entropy_floor", floor, sync_dist=True, reduce_fx="max")
