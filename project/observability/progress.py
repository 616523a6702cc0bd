"""The progress bar: Lightning's Rich bar, redrawn a few times a second rather than at every batch, and labelled
with its job in a sweep."""

import sys
import time

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar

from project.options.option_types import NonNegativeFloat

PIPED_WIDTH = 200  # columns of the console when the output is not a terminal


class TimedRichProgressBar(RichProgressBar):
    """``RichProgressBar``, redrawn at most every ``min_interval_s`` seconds and at the last batch of each loop.

    Lightning's bars redraw every ``refresh_rate`` batches, whatever a batch takes: at every batch, a redraw (and
    the metrics it shows) costs some 0.2 ms, 5% of a small model's step on a CPU; no rate suits both a 4 ms and a
    4 s step. A person reading the bar needs no more than ~10 redraws a second.
    """

    def __init__(self, min_interval_s: NonNegativeFloat = 0.1, label: str | None = None, **kwargs) -> None:
        if not sys.stdout.isatty():
            # Piped or logged (a file, CI, a sweep's log): Rich's console is then 80 columns wide, and each epoch's
            # finished bar prints its metrics as a column, a line a metric. Wide, the bar and its metrics make a line.
            kwargs["console_kwargs"] = {"width": PIPED_WIDTH, **(kwargs.get("console_kwargs") or {})}
        super().__init__(**kwargs)
        self.min_interval_s = min_interval_s
        self.label = label  # before each bar's description: which job of a sweep (parallel jobs share a terminal)
        self._last_redraw = 0.0

    def _labelled(self, description: str) -> str:
        return description if self.label is None else f"{self.label} · {description}"

    def _get_train_description(self, current_epoch: int) -> str:
        return self._labelled(super()._get_train_description(current_epoch))

    @property
    def validation_description(self) -> str:
        return self._labelled(super().validation_description)

    @property
    def sanity_check_description(self) -> str:
        return self._labelled(super().sanity_check_description)

    def _due(self, batch_idx: int, total: int | float) -> bool:
        now = time.monotonic()
        if now - self._last_redraw < self.min_interval_s and batch_idx + 1 < total:
            return False
        self._last_redraw = now
        return True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if not self.is_disabled and self._due(batch_idx, self.total_train_batches):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not self.is_disabled and self._due(batch_idx, self.total_val_batches_current_dataloader):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
