"""Classification: cross-entropy, accuracy and mean loss, logged once per epoch."""

from typing import cast

import torch
from torch import nn

from project.job.layout import DataShape
from project.models.sequence import BlockSequence
from project.tasks.base import TrainingModule
from project.tasks.metrics import SampleAccuracy, SampleMean


def _classification_metrics() -> nn.ModuleDict:
    return nn.ModuleDict({"loss": SampleMean(), "acc": SampleAccuracy()})


class ClassificationModule(TrainingModule):
    """``net`` maps inputs to class logits. ``val/loss`` and ``val/acc`` are exact full-set values for any device
    count: the metrics accumulate per-sample sums on each rank and are reduced once at epoch end."""

    def __init__(self, net: BlockSequence, **kwargs) -> None:
        super().__init__(net, **kwargs)
        self.criterion = nn.CrossEntropyLoss()
        self.train_metrics = _classification_metrics()
        self.val_metrics = _classification_metrics()

    def update_task_metrics(self, metrics: nn.ModuleDict, outputs: torch.Tensor, target: torch.Tensor) -> None:
        cast(SampleAccuracy, metrics["acc"]).update(outputs, target)

    def example_batch(self, batch_size: int, data: DataShape) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of the shapes and dtypes the data module (of ``data``'s shape) feeds: features and labels."""
        assert data.num_features is not None, "a classifier's data has features"
        return torch.zeros(batch_size, data.num_features), torch.zeros(batch_size, dtype=torch.long)
