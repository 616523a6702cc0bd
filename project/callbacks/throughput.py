"""Per-epoch throughput: how fast the whole job trains, and how fast each device does."""

import time

import lightning as L
import torch
from lightning.pytorch.utilities.data import extract_batch_size

from project.callbacks.memory import gather_from_ranks
from project.data.sampling import data_parallel_rank_and_size


class EpochThroughput(L.Callback):
    """Logs ``perf/samples_per_sec`` (the job), ``perf/samples_per_sec_per_device``, ``perf/epoch_time_s`` and, when
    the inputs are token ids, ``perf/tokens_per_sec`` (the job).

    The rates count training time only: the train clock runs from the epoch start and stops while the epoch
    validates (and during what follows validation, such as checkpointing, until the next training batch starts).
    It is read with the device synchronised. ``perf/epoch_time_s`` is the whole epoch as a user waits for it,
    validation included (of a run resumed mid-epoch: the part it ran). ``per_device`` holds each rank's rates of the epoch (``rank`` and the per-device
    ``perf/*`` keys), on every rank.
    """

    def __init__(self) -> None:
        self._epoch_start = 0.0
        self._segment_start: float | None = None  # when the train clock last started; None while it is stopped
        self._train_time = 0.0
        self._samples = 0
        self._tokens = 0
        self.per_device: list[dict[str, float]] = []

    def _now(self, pl_module: L.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def _stop_train_clock(self, pl_module: L.LightningModule) -> None:
        if self._segment_start is not None:
            self._train_time += self._now(pl_module) - self._segment_start
            self._segment_start = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A run resumed mid-epoch gets no on_train_epoch_start for that epoch: time its part of the epoch.
        self._epoch_start = self._now(pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._epoch_start = self._segment_start = self._now(pl_module)
        self._train_time = 0.0
        self._samples = 0
        self._tokens = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if self._segment_start is None:  # the first batch after a validation
            self._segment_start = self._now(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        self._samples += extract_batch_size(batch)
        inputs = batch[0]
        if not torch.is_floating_point(inputs):  # token ids: every element is a token
            self._tokens += inputs.numel()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:  # a validation inside a training epoch pauses its clock
            self._stop_train_clock(pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_train_clock(pl_module)
        epoch_time = time.perf_counter() - self._epoch_start
        rate = self._samples / self._train_time  # samples this rank's device processed per second
        _, replicas = data_parallel_rank_and_size(trainer)
        # A replica's ranks (its pipeline stages) all see the replica's samples: count them once. sync_dist
        # reduces across ranks with reduce_fx: the job's rate is the sum of the ranks' shares.
        share = replicas / trainer.world_size
        pl_module.log("perf/samples_per_sec", rate * share, sync_dist=True, reduce_fx="sum")
        if self._tokens:
            pl_module.log("perf/tokens_per_sec", self._tokens / self._train_time * share, sync_dist=True, reduce_fx="sum")
        pl_module.log("perf/samples_per_sec_per_device", rate, sync_dist=True, reduce_fx="mean")
        pl_module.log("perf/epoch_time_s", epoch_time, sync_dist=True, reduce_fx="max")
        own = {"rank": trainer.global_rank, "perf/samples_per_sec_per_device": rate}
        if self._tokens:
            own["perf/tokens_per_sec_per_device"] = self._tokens / self._train_time
        self.per_device = gather_from_ranks([own])
