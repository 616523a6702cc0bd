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
    """Trains ``net`` (any ``nn.Module`` mapping inputs to class logits, exposing ``blocks``).

    Metrics are torchmetrics objects: they accumulate per-sample sums on each rank and are reduced across
    ranks once at epoch end, so ``val/loss`` and ``val/acc`` are the exact full-set values for any device count.

    What strategies may use: ``configure_model`` hands ``net`` to ``strategy.parallelize`` (FSDP shards it,
    model/pipeline parallelism split it); a pipeline strategy runs the steps itself with ``criterion`` as the
    per-micro-batch loss, feeding ``update_metrics`` where outputs exist and calling ``log_metrics`` on every rank.
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
        self.train_metrics = nn.ModuleDict({"loss": MeanMetric(), "acc": MulticlassAccuracy(num_classes, average="micro")})
        self.val_metrics = nn.ModuleDict({"loss": MeanMetric(), "acc": MulticlassAccuracy(num_classes, average="micro")})

    def configure_model(self) -> None:
        """Let the strategy parallelise the plain model; a no-op for DDP and one device."""
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None:
            parallelize(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def update_metrics(
        self, split: str, logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor
    ) -> None:
        """Add a batch to ``split``'s metrics (train or val)."""
        metrics = self.train_metrics if split == "train" else self.val_metrics
        # Weighting by batch size makes the epoch value the mean over samples, whatever the batch sizes.
        metrics["loss"].update(loss.detach(), weight=target.numel())
        metrics["acc"].update(logits.detach(), target)

    def log_metrics(self, split: str) -> None:
        """Log ``split``'s metrics for the epoch (reduced across ranks once, at epoch end)."""
        metrics = self.train_metrics if split == "train" else self.val_metrics
        self.log_dict(
            {f"{split}/{name}": metric for name, metric in metrics.items()}, on_step=False, on_epoch=True, prog_bar=True
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.criterion(logits, y)
        self.update_metrics("train", logits, y, loss)
        self.log_metrics("train")
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.update_metrics("val", logits, y, self.criterion(logits, y))
        self.log_metrics("val")

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer)}}
