"""Classification: cross-entropy, torchmetrics accuracy and mean loss, logged once per epoch."""

import torch
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from project.modules.base import TrainingModule


def _classification_metrics(num_classes: int) -> nn.ModuleDict:
    return nn.ModuleDict({"loss": MeanMetric(), "acc": MulticlassAccuracy(num_classes, average="micro")})


class ClassificationModule(TrainingModule):
    """``net`` maps inputs to class logits. ``val/loss`` and ``val/acc`` are exact full-set values for any device
    count: the metrics accumulate per-sample sums on each rank and are reduced once at epoch end."""

    def __init__(self, net: nn.Module, num_classes: int, **kwargs) -> None:
        super().__init__(net, **kwargs)
        self.criterion = nn.CrossEntropyLoss()
        self.train_metrics = _classification_metrics(num_classes)
        self.val_metrics = _classification_metrics(num_classes)

    def update_task_metrics(self, metrics: nn.ModuleDict, outputs: torch.Tensor, target: torch.Tensor) -> None:
        metrics["acc"].update(outputs, target)
