"""Checkpoints of a run: the best by the model's metric, and ``last.ckpt`` always the latest checkpoint."""

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from project.checkpointing.background import WritesInBackground
from project.options.config_rules import ConfigRules, RunData
from project.options.errors import check_writable


class LatestAndBestCheckpoint(ModelCheckpoint, ConfigRules):
    """Lightning's ModelCheckpoint, with ``last.ckpt`` written at the end of every epoch, after every validation and
    every ``every_n_train_steps`` optimizer steps.

    Lightning 2.6 writes ``last`` at an epoch's end only when it also saved a top-k checkpoint there, i.e. when the
    epoch ended with a validation whose monitored metric improved; after a run of worse epochs, ``ckpt_path=last``
    would silently repeat them. And it defers the step saves, ``last`` included, until the monitored metric exists:
    a long first epoch, validated at its end, would have no checkpoint until then.

    ``async_save``: a strategy that saves distributed checkpoints (fsdp, tensor_parallel, pipeline) writes them in
    the background while training goes on (``project.checkpointing.background``); the others write their one file
    before training goes on, as with ``async_save=False``. Training ends once the last write is on disk.
    """

    def __init__(self, *args: Any, async_save: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.async_save = async_save

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if isinstance(trainer.strategy, WritesInBackground):
            trainer.strategy.async_save = self.async_save

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(trainer.strategy, WritesInBackground):
            trainer.strategy.finish_checkpoint_writes()

    @staticmethod
    def check_run_config(cfg: DictConfig, node: str, data: RunData) -> None:
        """The checkpoints dir must be writable before any worker starts, not when the first epoch ends."""
        key = f"{node}.dirpath"
        dirpath = OmegaConf.select(cfg, key)
        if dirpath is not None:
            check_writable(key, dirpath, f"make {dirpath} writable, or set {key} to a dir you can write.")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        deferred_before, self._defer_save_until_validation = self._defer_save_until_validation, False
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        deferred_now = self._defer_save_until_validation
        self._defer_save_until_validation = deferred_before or deferred_now
        if not (deferred_now and self.save_last):
            return  # the monitor candidates (a copy of every logged metric) only when there is something to save
        candidates = self._monitor_candidates(trainer)
        if self.monitor not in candidates:  # no validation yet
            step_saved = self._last_global_step_saved
            self._save_last_checkpoint(trainer, candidates)
            # Lightning skips a step marked saved: the top-k save it deferred to the validation must still happen.
            self._last_global_step_saved = step_saved

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        self._save_last_if_missed(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_missed(trainer)

    def _save_last_if_missed(self, trainer: L.Trainer) -> None:
        # Lightning sets _last_global_step_saved on every save, so it lags only when this point saved nothing.
        if (
            self.save_last
            and not self._should_skip_saving_checkpoint(trainer)
            and self._last_global_step_saved != trainer.global_step
        ):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
