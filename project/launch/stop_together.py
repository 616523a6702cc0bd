"""Stopping every rank at the same point of training: on SIGTERM (a preemption, a cancelled job), cleanly; on a
non-finite training loss or gradient norm (divergence), as a failure that names the step and the last checkpoint
saved before it."""

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist

from project.options.errors import JobFailed

log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")  # where Lightning says it


class TrainingDiverged(JobFailed):
    """The training loss, or the gradient norm, stopped being finite; every rank raises it after the same step."""


class StopTogether(L.Callback):
    """Every rank stops after the same training batch (or at the same epoch's end) once any rank got SIGTERM, and
    fails after the same batch once any rank's training loss is not finite (NaN or infinite), or, when gradients
    are clipped, its gradients (``TrainingModule.gradients_finite``: clipped by a non-finite norm, every gradient
    and then every parameter turns NaN, though the step's loss was finite).

    Lightning's own SIGTERM handler broadcasts from rank 0 inside the signal handler: a collective started wherever
    the signal lands, which pairs with whatever collective the other ranks are in at that moment (a checkpoint's
    metric reduction, a barrier) and can hang them all until the launcher's timeout. And its loops stop a rank on
    its own flag, at points the ranks reach at different times, so a rank signalled a moment later trains on alone
    into a collective nobody joins. Here the handler only notes the signal; after each training or validation batch
    and at each epoch's end, with every rank at the same point, the ranks agree (one all-reduce of both notes) and
    set Lightning's flag together, so its loops stop all of them at once.

    A diverged step raises ``TrainingDiverged`` on every rank before any checkpoint of it is written (Lightning
    runs checkpoint callbacks after the others): the job fails, and a sweep records the trial as failed with the
    message. Only one rank of a pipeline (its last stage) has the loss; the agreement tells the others.

    ``step_checks`` (the config's): reading the agreed flags waits for the device to finish the step. On a GPU that
    wait each step keeps the host from queueing the next step while the GPU runs this one, which a step whose
    kernels launch faster than they run hides, but a short one pays in full. ``a_step_late`` reads each training
    step's flags after the next step is queued: a diverged step is named as before, and training stops one step
    later; the flags are read at once before any checkpoint is written (``on_save_checkpoint``), at each
    validation and at the epoch's end, so no checkpoint holds a diverged step. ``each_step`` reads them after their
    own step. ``auto``: a step late on CUDA devices, each step elsewhere (where reading waits for nothing).
    """

    def __init__(self, step_checks: Literal["auto", "each_step", "a_step_late"] = "auto") -> None:
        self.step_checks = step_checks
        self._signalled = False
        self._cause: str | None = None  # what was not finite on this rank, for the message
        self._late = False  # reading a step late (on_train_start decides)
        self._pending: _Flags | None = None  # a step's flags not read yet

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        def note(signum: int, frame) -> None:
            log.info(f"[rank: {trainer.local_rank}] Received SIGTERM: {signum}")
            if not self._signalled and trainer.strategy.launcher is not None:
                trainer.strategy.launcher.kill(signum)  # processes Lightning itself started, as Lightning does
            self._signalled = True

        # Read when fit registers its handlers, after setup. (Lightning's private method, replaced on the instance.)
        trainer._signal_connector._sigterm_notifier_fn = note  # type: ignore[method-assign,assignment]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        cuda = trainer.strategy.root_device.type == "cuda"
        self._late = self.step_checks == "a_step_late" or (self.step_checks == "auto" and cuda)
        # Lightning broadcasts rank 0's SIGTERM flag before every training step of a distributed run and reads it:
        # a collective and a device sync per step, which the agreement here already makes (a private method,
        # replaced on the instance).
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]

    def _flags(
        self, trainer: L.Trainer, loss: torch.Tensor | None = None, gradients_finite: torch.Tensor | None = None
    ) -> "_Flags":
        """This rank's notes (signalled; ``loss`` or gradients not finite), agreed over the ranks on the device (one
        all-reduce, queued), with what the message needs once they are read."""
        if not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
            # One rank agrees with itself: read its notes as they are, without the tensors a collective needs (an
            # op costs a small model's step on a CPU some 10 us).
            return _Flags(None, self._signalled, loss, gradients_finite, trainer.global_step, trainer.current_epoch)
        device = trainer.strategy.root_device
        no = torch.zeros((), dtype=torch.bool, device=device)
        bad_loss = no if loss is None else (~torch.isfinite(loss.detach())).any()
        bad_gradients = no if gradients_finite is None else ~gradients_finite.to(device)
        agreed = torch.stack([torch.tensor(self._signalled, device=device), bad_loss | bad_gradients]).float()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        return _Flags(agreed, self._signalled, loss, gradients_finite, trainer.global_step, trainer.current_epoch)

    def _read(self, trainer: L.Trainer, flags: "_Flags", batch_idx: int | None = None) -> bool:
        """Read ``flags`` (waiting for the device): set Lightning's stop flag if any rank was signalled, raise
        ``TrainingDiverged`` (after step ``flags.step``) if any rank's step was not finite; whether signalled."""
        if flags.agreed is None:
            signalled, any_diverged = flags.signalled, flags.bad_loss or flags.bad_gradients
        else:
            signalled, any_diverged = (bool(flag) for flag in flags.agreed.tolist())
        if signalled:
            trainer._signal_connector.received_sigterm = True
        if not any_diverged:
            return signalled
        if flags.loss is not None and flags.bad_loss:
            self._cause = (
                f"the training loss was not finite (rank {trainer.global_rank}'s was {float(flags.loss.sum())})"
            )
        elif flags.bad_gradients:
            self._cause = f"the gradient norm was not finite (on rank {trainer.global_rank})"
        raise self._divergence(trainer, flags, batch_idx)

    def _agree(self, trainer: L.Trainer) -> bool:
        """Read the flags of the step not read yet, then agree on a signal now (one device sync, as Lightning's own
        check at each batch's start has); whether any rank was signalled."""
        self._read_pending(trainer)
        return self._read(trainer, self._flags(trainer))

    def _read_pending(self, trainer: L.Trainer) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._read(trainer, pending, pending.batch_idx)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        gradients_finite = getattr(pl_module, "gradients_finite", None)  # the last optimizer step's, when clipping
        flags = self._flags(trainer, loss if isinstance(loss, torch.Tensor) else None, gradients_finite)
        flags.batch_idx = batch_idx
        if not self._late:
            self._read(trainer, flags, batch_idx)
            return
        self._read_pending(trainer)  # the previous step's: done on the device by now, or nearly
        self._pending = flags

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._read_pending(trainer)  # no checkpoint of a diverged step: every rank builds one, so all read here

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read_pending(trainer)

    def _divergence(self, trainer: L.Trainer, flags: "_Flags", batch_idx: int | None) -> TrainingDiverged:
        checkpoint = getattr(trainer.checkpoint_callback, "last_model_path", "") or getattr(
            trainer.checkpoint_callback, "best_model_path", ""
        )
        cause = self._cause or "the training loss or gradient norm was not finite on another rank"
        remedy = "a lower model.optimizer.lr" + (
            "" if trainer.gradient_clip_val else ", or a trainer.gradient_clip_val"
        )
        resume = (
            f"The last checkpoint, saved before it: {checkpoint}; resume from it (ckpt_path={checkpoint}) with "
            f"{remedy}."
            if checkpoint
            else f"No checkpoint was saved before it; start again with {remedy}."
        )
        message = (
            f"Training diverged at global step {flags.step} (epoch {flags.epoch}, batch {batch_idx}): {cause}. "
            f"Every rank stopped after {'the next step' if trainer.global_step > flags.step else 'this step'}. "
            f"{resume}"
        )
        logging.getLogger(__name__).error(message)
        return TrainingDiverged(message)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._agree(trainer)

    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._agree(trainer)  # every rank runs as many validation batches (GlobalBatchSampler), so all are here


@dataclass
class _Flags:
    """One step's flags: agreed over the ranks on the device (any rank signalled, any rank's step not finite; None
    for one rank, which reads its own), this rank's own notes, and the step they are of."""

    agreed: torch.Tensor | None
    signalled: bool
    loss: torch.Tensor | None
    gradients_finite: torch.Tensor | None
    step: int
    epoch: int
    batch_idx: int | None = None

    @property
    def bad_loss(self) -> bool:
        return self.loss is not None and not bool(torch.isfinite(self.loss.detach()).all())

    @property
    def bad_gradients(self) -> bool:
        return self.gradients_finite is not None and not bool(self.gradients_finite)
