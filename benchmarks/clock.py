"""The benchmark's own clock inside a framework run, added as ``+callbacks.clock._target_=benchmarks.clock.EpochClock``.

Rank 0 appends ``{"event": ..., "time": time.time()}`` lines to ``path``: each training epoch's start, the end of
the first training step and the end of training: the same events ``benchmarks/hand_loop.py`` stamps.
"""

import json
import time

import lightning as L


class EpochClock(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def _stamp(self, trainer: L.Trainer, event: str) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "a") as clock:
                clock.write(json.dumps({"event": event, "time": time.time()}) + "\n")

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stamp(trainer, "epoch_start")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if trainer.global_step == 1 and trainer.current_epoch == 0 and batch_idx == 0:
            self._stamp(trainer, "first_step")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stamp(trainer, "end")
