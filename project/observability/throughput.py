"""Per-epoch throughput: how fast the whole job trains, and how fast each device does."""

import copy
import time

import lightning as L
import torch

from project.accounting.memory_trackers import gather_from_ranks
from project.data.sampling import data_parallel_rank_and_size
from project.observability.flops import peak_tflops, training_flops_per_sample


class EpochThroughput(L.Callback):
    """Logs ``perf/samples_per_sec`` (the job), ``perf/samples_per_sec_per_device``, ``perf/epoch_time_s``, when
    the inputs are token ids ``perf/tokens_per_sec`` (the job), and ``perf/tflops_per_device``: the model FLOPs of
    training (``project.observability.flops``) the job did per second, per device; on a GPU whose peak is known
    (``project.observability.flops.PEAK_TFLOPS``) also ``perf/mfu``, that as a fraction of the device's peak at the
    run's
    precision (model FLOPs utilisation).

    The rates count training time only: the train clock runs from the epoch start and stops while the epoch
    validates (and during what follows validation, such as checkpointing, until the next training batch starts).
    It is read with the device synchronised. ``perf/epoch_time_s`` is the whole epoch as a user waits for it,
    validation included (of a run resumed mid-epoch: the part it ran). ``per_device`` holds each rank's rates of the
    epoch (``rank`` and the per-device
    ``perf/*`` keys), on every rank.
    """

    def __init__(self) -> None:
        self._epoch_start = 0.0
        self._segment_start: float | None = None  # when the train clock last started; None while it is stopped
        self._train_time = 0.0
        self._samples = 0
        self._tokens = 0
        self._meta_net: torch.nn.Module | None = None  # the whole model on the meta device, to count its FLOPs
        self._flops_per_sample: int | None = None
        self.per_device: list[dict[str, float]] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Before configure_model: the model is still whole (not yet sharded or split) and on the meta device, so a
        # copy costs nothing.
        net = getattr(pl_module, "net", None)
        if net is not None and all(parameter.is_meta for parameter in net.parameters()):
            self._meta_net = copy.deepcopy(net)

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

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        inputs = batch[0]
        self._samples += len(inputs)  # rows: a preference pair's two sequences count as two (data=preference)
        if self._flops_per_sample is None and self._meta_net is not None:
            self._flops_per_sample = training_flops_per_sample(self._meta_net, inputs)
            self._meta_net = None
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
            pl_module.log(
                "perf/tokens_per_sec", self._tokens / self._train_time * share, sync_dist=True, reduce_fx="sum"
            )
        pl_module.log("perf/samples_per_sec_per_device", rate, sync_dist=True, reduce_fx="mean")
        if self._flops_per_sample is not None:
            # The mean over ranks of their shares of the job's rate: the job's model FLOPs per second per device.
            tflops = self._flops_per_sample * rate * share / 1e12
            pl_module.log("perf/tflops_per_device", tflops, sync_dist=True, reduce_fx="mean")
            peak = self._peak_tflops(trainer, pl_module)
            if peak is not None:
                pl_module.log("perf/mfu", tflops / peak, sync_dist=True, reduce_fx="mean")
        pl_module.log("perf/epoch_time_s", epoch_time, sync_dist=True, reduce_fx="max")
        own = {"rank": trainer.global_rank, "perf/samples_per_sec_per_device": rate}
        if self._tokens:
            own["perf/tokens_per_sec_per_device"] = self._tokens / self._train_time
        self.per_device = gather_from_ranks([own])

    @staticmethod
    def _peak_tflops(trainer: L.Trainer, pl_module: L.LightningModule) -> float | None:
        if pl_module.device.type != "cuda":
            return None
        tf32 = torch.get_float32_matmul_precision() != "highest"
        return peak_tflops(torch.cuda.get_device_name(pl_module.device), str(trainer.precision), tf32)
