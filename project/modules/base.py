"""What every task's LightningModule shares: the steps, the optimizer, and the protocol strategies rely on."""

from collections.abc import Callable

import lightning as L
import torch
from torch import nn

from project.parallel import apply_activation_checkpointing

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


class TrainingModule(L.LightningModule):
    """Trains ``net`` (a plain model, ``head(blocks(stem(x)))``) on ``(inputs, targets)`` batches.

    Subclasses set ``criterion`` (loss of a batch or micro-batch), ``train_metrics`` and ``val_metrics``
    (ModuleDicts of torchmetrics with a ``loss`` MeanMetric, reduced across ranks once at epoch end) and
    ``update_task_metrics`` for the metrics beyond the loss.

    The protocol strategies use: ``configure_model`` hands ``net`` to ``strategy.parallelize`` (FSDP shards it,
    model/pipeline parallelism split it); a pipeline strategy runs the steps itself with ``criterion`` per
    micro-batch, feeds ``update_metrics`` where outputs exist and calls ``log_metrics`` on every rank.
    """

    criterion: nn.Module
    train_metrics: nn.ModuleDict
    val_metrics: nn.ModuleDict

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.activation_checkpointing = activation_checkpointing

    def configure_model(self) -> None:
        if self.activation_checkpointing:
            apply_activation_checkpointing(self.net)
        parallelize = getattr(self.trainer.strategy, "parallelize", None)
        if parallelize is not None:  # a no-op for DDP and one device
            parallelize(self.net)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def metrics_for(self, split: str) -> nn.ModuleDict:
        return self.train_metrics if split == "train" else self.val_metrics

    def update_metrics(self, split: str, outputs: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        """Add a batch to ``split``'s metrics (train or val)."""
        metrics = self.metrics_for(split)
        # Weighted by the targets it averages over, the epoch's loss is the mean over all samples (or tokens),
        # whatever the batch sizes.
        metrics["loss"].update(loss.detach(), weight=target.numel())
        self.update_task_metrics(metrics, outputs.detach(), target)

    def update_task_metrics(self, metrics: nn.ModuleDict, outputs: torch.Tensor, target: torch.Tensor) -> None:
        raise NotImplementedError

    def log_metrics(self, split: str) -> None:
        """Log ``split``'s metrics (train or val) for the epoch."""
        metrics = self.metrics_for(split)
        self.log_dict(
            {f"{split}/{name}": metric for name, metric in metrics.items()}, on_step=False, on_epoch=True, prog_bar=True
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        outputs = self(inputs)
        loss = self.criterion(outputs, target)
        self.update_metrics("train", outputs, target, loss)
        self.log_metrics("train")
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, target = batch
        outputs = self(inputs)
        self.update_metrics("val", outputs, target, self.criterion(outputs, target))
        self.log_metrics("val")

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(params=self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        # Schedules here are per optimizer step (warmup and cosine over steps).
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "step"}}
