"""Per-epoch memory of one device: what the model state costs, so the dashboard shows why a strategy helps."""

import json
from copy import deepcopy
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed.tensor import DTensor

from project.config.option_types import NonNegativeInt

MB = 2**20


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this device holds of ``tensor``: its local shard when sharded (FSDP's DTensors)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def model_state_bytes_per_device(
    module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], placement: dict[int, int] | None = None
) -> dict[int, dict[str, int]]:
    """Parameters, gradients and optimizer state held by each device of this process.

    ``placement`` maps ``id(parameter)`` to the device (stage) holding it, for a process that drives several
    (``strategy=model_parallel``); by default the process has one device, 0.
    """
    placement = placement or {}
    per_device: dict[int, dict[str, int]] = {}

    def add(parameter: torch.Tensor, part: str, tensor: torch.Tensor) -> None:
        sizes = per_device.setdefault(placement.get(id(parameter), 0), {"params": 0, "grads": 0, "optimizer": 0})
        sizes[part] += local_bytes(tensor)

    parameter: torch.Tensor  # the module's parameters, then the optimizers' state keys
    for parameter in module.parameters():
        add(parameter, "params", parameter)
        if parameter.grad is not None:
            add(parameter, "grads", parameter.grad)
    for optimizer in optimizers:
        for parameter, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add(parameter, "optimizer", value)
    return per_device


def gather_from_ranks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's ``rows``, in rank order (this process's alone when it is the only one)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    gathered: list[list[dict[str, Any]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, rows)
    return [row for rank_rows in gathered for row in rank_rows]


class _NoModuleHooks:
    """What ``MemTracker`` asks of its ``ModTracker``, hooking no module: its hooks only attribute memory to
    modules, refuse a module run twice per step (a pipeline stage's micro-batches), and break the pipeline's
    partial backward (``autograd.grad`` on a stage's inputs)."""

    is_bw = False

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> "_NoModuleHooks":
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class ShapeInferenceUntracked:
    """For torch's memory trackers: an op run under a fake mode other than the one in force when tracking began is
    DTensor inferring an output's shape (on fake tensors of the global shape), not memory of the step. torch 2.13's
    trackers leave such ops out themselves; 2.11's count them (a plan of FSDP over 1024 ranks then held every
    parameter whole, over again, in the optimizer step). This does what 2.13 does, on either."""

    def __enter__(self):
        self._fake_mode_at_start = active_fake_mode()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if active_fake_mode() is not self._fake_mode_at_start:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class OverCapacity(Exception):
    """A tracked step held more than its tracker's ``stop_above`` bytes: raised from the op that made it so."""


class StepPeakOnly(MemTracker):
    """Torch's ``MemTracker`` keeping the step's peak, not each module's. ``MemTracker`` walks every module it has
    seen at each op to raise the peaks of those running; plans read only the step's, and under FSDP's tracker that
    walk is a large share of a simulation's time. What is left is torch's own code for the step's peak. With
    ``stop_above`` set, the first op after which a device holds more raises ``OverCapacity``."""

    stop_above: int | None = None

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = deepcopy(snapshot)
                if self.stop_above is not None and device.type != "meta" and snapshot[_TOTAL_KEY] > self.stop_above:
                    raise OverCapacity


class StepFSDPMemTracker(StepPeakOnly, ShapeInferenceUntracked, FSDPMemTracker):
    """PyTorch's ``FSDPMemTracker``: ``MemTracker`` that also tells FSDP's gathered parameters and collective
    buffers apart."""


class StepMemoryTracker(StepPeakOnly, ShapeInferenceUntracked, MemTracker):
    """PyTorch's ``MemTracker`` (every tensor's storage, as it is made and freed, on each device) for the totals
    and peak of whole training steps, not per module. Tensors made before it starts count once handed to
    ``track_external`` (the model, the optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        # A stand-in with the part of ModTracker's interface MemTracker uses.
        self._mod_tracker = _NoModuleHooks()  # type: ignore[assignment]


def held_bytes(tracker: MemTracker, snapshot: str = "current") -> int:
    """Bytes a ``MemTracker`` counts as held, now or at its peak (``snapshot="peak"``), over the devices it saw
    (shape-only meta tensors, e.g. a FLOP count's model copy, hold none)."""
    return sum(
        sizes["Total"] for device, sizes in tracker.get_tracker_snapshot(snapshot).items() if device.type != "meta"
    )


class DeviceMemory(L.Callback):
    """Logs ``memory/{params,grads,optimizer,model_state}_mb`` and, on CUDA, ``memory/peak_{allocated,reserved}_mb``;
    next to them, the job's memory plan (``project.memory.plan``, read from ``plan_file``) as
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
        placement = getattr(trainer.strategy, "parameter_stage", None)
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
            for name in ("params", "grads", "optimizer"):
                pl_module.log(f"memory/planned_{name}_mb", planned[name] / MB)
            pl_module.log(
                "memory/planned_model_state_mb", (planned["params"] + planned["grads"] + planned["optimizer"]) / MB
            )
            pl_module.log("memory/planned_peak_mb", plan["peak"] / MB)
