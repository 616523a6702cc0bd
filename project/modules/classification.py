"""Classification LightningModule: cross-entropy, torchmetrics accuracy and mean loss, logged once per epoch."""

from collections.abc import Callable

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


class ClassificationModule(L.LightningModule):
    """Trains ``net`` (any ``nn.Module`` mapping inputs to class logits).

    Metrics are torchmetrics objects: they accumulate per-sample sums on each rank and are reduced across
    ranks once at epoch end, so ``val/loss`` and ``val/acc`` are the exact full-set values for any device count.
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.criterion = nn.CrossEntropyLoss()
        self.train_loss, self.val_loss = MeanMetric(), MeanMetric()
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")

    def configure_model(self) -> None:
        """Let the strategy parallelise the plain model (FSDP shards it per block); a no-op for DDP and one device."""
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None:
            parallelize(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], loss_metric: MeanMetric, acc_metric) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.criterion(logits, y)
        # Weighting by batch size makes the epoch value the mean over samples, whatever the batch sizes.
        loss_metric.update(loss.detach(), weight=y.numel())
        acc_metric.update(logits.detach(), y)
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._step(batch, self.train_loss, self.train_acc)
        self.log_dict({"train/loss": self.train_loss, "train/acc": self.train_acc}, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, self.val_loss, self.val_acc)
        self.log_dict({"val/loss": self.val_loss, "val/acc": self.val_acc}, on_step=False, on_epoch=True)

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer)}}
