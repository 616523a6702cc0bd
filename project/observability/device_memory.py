"""Per-epoch memory of one device: what the model state costs, so the dashboard shows why a strategy helps."""

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch

from project.accounting.memory_trackers import (
    MB,
    StepMemoryTracker,
    gather_from_ranks,
    held_bytes,
    model_state_bytes_per_device,
)
from project.options.option_types import NonNegativeInt
from project.strategies.laid_out import LaidOutStrategy


class DeviceMemory(L.Callback):
    """Logs ``memory/{params,grads,optimizer,model_state}_mb`` and, on CUDA, ``memory/peak_{allocated,reserved}_mb``;
    next to them, the job's memory plan (``project.plan.memory_plan``, read from ``plan_file``) as
    ``memory/planned_{params,grads,optimizer,model_state,peak}_mb``.

    Each value is the maximum over devices: the device that runs out first is the one that matters. Model state
    is measured just before optimizer steps, when gradients exist (Lightning frees them after the step), until
    two steps agree, and the epoch's last measurement is logged; CUDA peaks cover the epoch, validation included.
    ``per_device`` holds the epoch's values of every device of the job (``rank``, ``stage`` and the ``memory/*``
    keys), on every rank.

    ``tracked_steps`` > 0 also measures the peak of the run's first that many training steps (a resumed run's
    too) by tracking every tensor
    (PyTorch's ``MemTracker``; it slows those steps), as ``memory/tracked_peak_mb``: the CPU has no allocator
    statistics. Stages of ``strategy=model_parallel`` on one CPU add up in it.
    """

    def __init__(self, plan_file: str | None = None, tracked_steps: NonNegativeInt = 0) -> None:
        self._sizes: dict[int, dict[str, int]] = {}
        self._settled_epoch: int | None = None  # the epoch whose sizes have stopped changing
        self.per_device: list[dict[str, Any]] = []
        self.plan_file = Path(plan_file) if plan_file else None
        self.tracked_steps = tracked_steps
        self._tracker: StepMemoryTracker | None = None
        self._tracked_until = 0  # the global step at which tracking stops
        self._tracked_peak: int | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.tracked_steps and self._tracker is None and self._tracked_peak is None:
            self._tracked_until = trainer.global_step + self.tracked_steps
            self._tracker = StepMemoryTracker()
            self._tracker.track_external(pl_module, *trainer.optimizers)
            self._tracker.__enter__()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._tracker is not None and trainer.global_step >= self._tracked_until:
            self._stop_tracking()

    def _stop_tracking(self) -> None:
        assert self._tracker is not None  # called only while tracking
        self._tracker.__exit__(None, None, None)
        self._tracked_peak = held_bytes(self._tracker, "peak")
        self._tracker = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        # The sizes change only while the optimizer creates its state (its first steps): once a measurement repeats
        # the one before, the epoch's later steps would repeat it too, and walking every parameter at every step
        # costs a small model more than its step.
        if self._settled_epoch == trainer.current_epoch:
            return
        strategy = trainer.strategy
        placement = strategy.parameter_stage if isinstance(strategy, LaidOutStrategy) else None
        sizes = model_state_bytes_per_device(pl_module, trainer.optimizers, placement)
        if sizes == self._sizes:
            self._settled_epoch = trainer.current_epoch
        self._sizes = sizes

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._tracker is not None:  # an epoch shorter than tracked_steps: its steps are what there was
            self._stop_tracking()
        rows = []
        for stage, parts in sorted((self._sizes or {0: {}}).items()):  # {}: no optimizer step this epoch
            sizes = dict(parts, model_state=sum(parts.values()))
            if pl_module.device.type == "cuda":
                sizes["peak_allocated"] = torch.cuda.max_memory_allocated(pl_module.device)
                sizes["peak_reserved"] = torch.cuda.max_memory_reserved(pl_module.device)
            rows.append(
                {
                    "rank": trainer.global_rank,
                    "stage": stage,
                    **{f"memory/{name}_mb": size / MB for name, size in sizes.items()},
                }
            )
        if self._tracked_peak is not None:
            for row in rows:
                row["memory/tracked_peak_mb"] = self._tracked_peak / MB
        self.per_device = gather_from_ranks(rows)
        fullest = max(rows, key=lambda row: row["memory/model_state_mb"])
        for name, value in fullest.items():
            if name.startswith("memory/"):
                pl_module.log(name, value, sync_dist=True, reduce_fx="max")
        plan = json.loads(self.plan_file.read_text()) if self.plan_file and self.plan_file.is_file() else None
        if plan is not None:  # the same rule: the device with the most model state, and the highest peak
            planned = max(plan["devices"], key=lambda device: device["params"] + device["grads"] + device["optimizer"])
            state = planned["params"] + planned["grads"] + planned["optimizer"]
            figures = {**{name: planned[name] for name in ("params", "grads", "optimizer")}, "model_state": state}
            # The same on every rank; reduced all the same, as Lightning warns five times a run otherwise.
            for name, value in {**figures, "peak": plan["peak"]}.items():
                pl_module.log(f"memory/planned_{name}_mb", value / MB, sync_dist=True, reduce_fx="max")
