"""The model summary at the start of training: Lightning's, counting the whole model where each rank holds only some
of its stages (a pipeline), not rank 0's stages alone."""

from collections.abc import Callable

import lightning as L
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary

from project.strategies.laid_out import LaidOutStrategy


class StagesSummary(ModelSummary):
    """``ModelSummary`` whose parameter counts (per layer, total, trainable) are this rank's summed by ``summed``
    over the ranks holding the model's other stages: Lightning counts the parameters the module holds."""

    def __init__(
        self, model: L.LightningModule, max_depth: int, summed: Callable[[dict[str, int]], dict[str, int]]
    ) -> None:
        super().__init__(model, max_depth)
        own = dict(zip((f"layer {name}" for name in self.layer_names), super().param_nums))
        counts = summed({**own, "total": super().total_parameters, "trainable": super().trainable_parameters})
        self._param_nums = [counts[name] for name in own]
        self._total, self._trainable = counts["total"], counts["trainable"]

    @property
    def param_nums(self) -> list[int]:
        return self._param_nums

    @property
    def total_parameters(self) -> int:
        return self._total

    @property
    def trainable_parameters(self) -> int:
        return self._trainable


class WholeModelSummary(RichModelSummary):
    """Lightning's Rich model summary (``max_depth`` levels of modules), its counts the whole model's under every
    strategy: one that lays out the model (``LaidOutStrategy``) sums them over the ranks holding its stages
    (``summed_over_stages``); every rank takes part, rank 0 prints."""

    def _summary(self, trainer: L.Trainer, pl_module: L.LightningModule) -> ModelSummary:
        if not isinstance(trainer.strategy, LaidOutStrategy):  # Lightning's own: every rank holds the whole model
            return super()._summary(trainer, pl_module)
        return StagesSummary(pl_module, self._max_depth, trainer.strategy.summed_over_stages)
