"""What a device holds: its model state counted tensor by tensor, and PyTorch's memory trackers set to follow whole
training steps (a memory plan's simulated step, or a run's first steps). Below both the plan and the callback that
logs a run's memory (``project.observability.device_memory``)."""

from copy import deepcopy
from typing import Any

import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from project.parallel.local_tensors import local_tensor

MB = 2**20


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this device holds of ``tensor``: its local shard when sharded (FSDP's DTensors); of a tensor subclass
    that stores its values in other tensors (torchao's NF4), theirs."""
    local = local_tensor(tensor)
    if is_traceable_wrapper_subclass(local):
        return sum(local_bytes(getattr(local, name)) for name in local.__tensor_flatten__()[0])
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
