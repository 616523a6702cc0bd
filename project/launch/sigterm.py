"""Stopping on SIGTERM (a preemption, a cancelled job) on every rank at the same point of training."""

import logging

import lightning as L
import torch
import torch.distributed as dist

log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")  # where Lightning says it


class StopTogetherOnSigterm(L.Callback):
    """Every rank stops after the same training batch (or at the same epoch's end) once any rank got SIGTERM.

    Lightning's own handler broadcasts from rank 0 inside the signal handler: a collective started wherever the
    signal lands, which pairs with whatever collective the other ranks are in at that moment (a checkpoint's metric
    reduction, a barrier) and can hang them all until the launcher's timeout. And its loops stop a rank on its own
    flag, at points the ranks reach at different times, so a rank signalled a moment later trains on alone into a
    collective nobody joins. Here the handler only notes the signal; after each training or validation batch and at
    each epoch's end, with every rank at the same point, the ranks agree (an all-reduce of the notes) and set
    Lightning's flag
    together, so its loops stop all of them at once.
    """

    def __init__(self) -> None:
        self._signalled = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        def note(signum: int, frame) -> None:
            log.info(f"[rank: {trainer.local_rank}] Received SIGTERM: {signum}")
            if not self._signalled and trainer.strategy.launcher is not None:
                trainer.strategy.launcher.kill(signum)  # processes Lightning itself started, as Lightning does
            self._signalled = True

        # Read when fit registers its handlers, after setup. (Lightning's private method, replaced on the instance.)
        trainer._signal_connector._sigterm_notifier_fn = note  # type: ignore[method-assign,assignment]

    def _agree(self, trainer: L.Trainer) -> None:
        signalled = self._signalled
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            flag = torch.tensor([int(signalled)], device=trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signalled = bool(flag.item())  # a device sync, as Lightning's own check at each batch's start is
        if signalled:
            trainer._signal_connector.received_sigterm = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        self._agree(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._agree(trainer)

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._agree(trainer)  # every rank runs as many validation batches (GlobalBatchSampler), so all are here
