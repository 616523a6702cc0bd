"""The job's result, for sweeps and for people: ``<job dir>/result.json``, written by rank 0 after every epoch."""

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.trainer.states import TrainerFn

from project.data.datamodule import trainer_data
from project.data.sampling import data_parallel_rank_and_size
from project.launch.results import job_result, write_result
from project.launch.trial import PruneTrial
from project.observability.device_memory import DeviceMemory
from project.observability.loggers import EpochWandbLogger
from project.observability.throughput import EpochThroughput
from project.options.errors import ConfigError, WriteFailed

log = logging.getLogger(__name__)


class JobResult(L.Callback):
    """Keeps each epoch's metrics and writes ``result.json``: the objective (the best value of ``metric`` over the
    epochs, ``mode`` max or min), the epoch it came from, the metrics of that epoch and of the last one, every
    epoch's (``history``), the status (``running`` after each epoch, then ``completed``, ``pruned`` or ``failed``), the
    runtime, one row per device of the latest epoch (``devices``: memory and throughput, where the ``memory`` and
    ``throughput`` callbacks run), also sent to W&B as the table ``devices``, and the batch (``batch_layout``).

    The epochs travel in checkpoints (``state_dict``), so a resumed job's result covers the whole run. The process
    Hydra runs reads the file (``project.launch.launcher``) and returns the objective to the sweeper, however the job
    ran.
    """

    def __init__(
        self,
        path: str | Path,
        metric: str,
        mode: str,
        pruning: PruneTrial | None = None,
        also: Sequence[str] = (),
    ) -> None:
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be max or min, got {mode!r}")
        self.path, self.metric, self.mode = Path(path), metric, mode
        self.also = list(also)  # the other metrics a multi-objective search is returned (optimized_metric.also)
        self.pruning = pruning  # a trial's pruner: a job it stopped ends ``pruned``, not ``completed``
        self.epochs: list[dict[str, float]] = []
        self.devices: list[dict[str, Any]] = []
        self.started = time.time()
        self.validated = False  # a validation (not Lightning's sanity check) has run

    def _check_metric_logged(self, trainer: L.Trainer) -> None:
        """``ConfigError`` once an epoch with a validation has logged everything, if ``metric`` or one of ``also``
        is not among it: every epoch would end without an objective (a search's trials all failing at their end,
        silently before)."""
        for key, names in (("optimized_metric.name", [self.metric]), ("optimized_metric.also", self.also)):
            missing = [name for name in names if name not in trainer.callback_metrics]
            if missing:
                logged = ", ".join(sorted(name for name in trainer.callback_metrics if not name.startswith("step/")))
                raise ConfigError(
                    key,
                    f"{'is' if key.endswith('name') else 'names'} {missing[0]!r}, which this run does not log.",
                    f"name one it logs: {logged}.",
                )

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.validated:
            self._check_metric_logged(trainer)
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        self.epochs.append({"epoch": trainer.current_epoch, **metrics})
        self.devices = per_device_rows(trainer)
        for logger in trainer.loggers:
            if isinstance(logger, EpochWandbLogger):
                logger.log_summary_table("devices", self.devices)
        self._write(trainer, "running")

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, "pruned" if self.pruning is not None and self.pruning.pruned else "completed")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validated = self.validated or not trainer.sanity_checking
        if trainer.state.fn == TrainerFn.VALIDATING:
            self._check_metric_logged(trainer)  # mode=eval: the one validation is the result
            self.epochs = [{"epoch": 0, **{name: float(value) for name, value in trainer.callback_metrics.items()}}]
            self._write(trainer, "completed")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        try:
            self._write(trainer, "failed", error=f"{type(exception).__name__}: {exception}")
        except WriteFailed as failure:  # the disk still full: say so, and let the job fail with its own error
            log.error(f"The job failed, but result.json could not say so: {failure}")

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": self.epochs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epochs = list(state_dict["epochs"])

    def _write(self, trainer: L.Trainer, status: str, error: str | None = None) -> None:
        if trainer.is_global_zero:
            write_result(
                self.path,
                job_result(
                    self.epochs,
                    self.metric,
                    self.mode,
                    status,
                    time.time() - self.started,
                    error,
                    self.devices,
                    batch_layout(trainer),
                ),
            )


def batch_layout(trainer: L.Trainer) -> dict[str, int]:
    """How a training step is fed: the data-parallel replicas that split each global batch (a pipeline's stages
    share one), the samples of each replica's batch, and the samples of one optimizer step (the global batch, times
    the accumulated batches)."""
    per_replica = trainer_data(trainer).batch_size
    _, replicas = data_parallel_rank_and_size(trainer)
    return {
        "data_parallel": replicas,
        "per_replica": per_replica,
        "global": per_replica * replicas * trainer.accumulate_grad_batches,
    }


def per_device_rows(trainer: L.Trainer) -> list[dict[str, Any]]:
    """One row per device of the job: the memory callback's measurements, with the throughput of the device's
    rank (every stage of a process sees its samples); rows of throughput alone without the memory callback."""
    # (callbacks: set on the Trainer by Lightning's callback connector, not declared by its class.)
    callbacks: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    memory = next((c.per_device for c in callbacks if isinstance(c, DeviceMemory)), [])
    rates = {row["rank"]: row for row in next((c.per_device for c in callbacks if isinstance(c, EpochThroughput)), [])}
    if not memory:
        return list(rates.values())
    return [{**row, **rates.get(row["rank"], {})} for row in memory]
