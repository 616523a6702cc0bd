"""Checkpoints of a run: the best by the model's metric, and ``last.ckpt`` always the latest checkpoint."""

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class LatestAndBestCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, with ``last.ckpt`` written at the end of every epoch (and after every validation).

    Lightning 2.6 writes ``last`` at an epoch's end only when it also saved a top-k checkpoint, i.e. when the
    monitored metric improved; after a run of worse epochs, ``ckpt_path=last`` would silently repeat them.
    Mid-epoch saves (``every_n_train_steps``) already write ``last`` every time.
    """

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_missed(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_missed(trainer)

    def _save_last_if_missed(self, trainer: L.Trainer) -> None:
        # Lightning sets _last_global_step_saved on every save, so it lags only when this point saved nothing.
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            if self._last_global_step_saved != trainer.global_step:
                self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
