"""Classification: cross-entropy, accuracy and mean loss, logged once per epoch."""

import torch
from torch import nn

from project.job.task import Loss
from project.models.sequence import BlockSequence
from project.tasks.base import TrainingModule, loss_sums
from project.tasks.metrics import SampleMean


def _classification_metrics() -> nn.ModuleDict:
    return nn.ModuleDict({"loss": SampleMean(), "acc": SampleMean()})


class ClassificationModule(TrainingModule):
    """``net`` maps inputs to class logits. ``val/loss`` and ``val/acc`` are exact full-set values for any device
    count: the metrics accumulate per-sample sums on each rank and are reduced once at epoch end."""

    def __init__(self, net: BlockSequence, **kwargs) -> None:
        super().__init__(net, **kwargs)
        self.criterion = nn.CrossEntropyLoss()
        self.train_metrics = _classification_metrics()
        self.val_metrics = _classification_metrics()

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> Loss:
        """The mean cross-entropy of the batch's class logits; ``acc``, the share of samples whose most likely class
        is the target."""
        value = self.criterion(outputs, target)
        return Loss(
            value, lambda: {**loss_sums(value, target), "acc": ((outputs.argmax(-1) == target).sum(), target.numel())}
        )
