"""Per-epoch memory of one device: what the model state costs, so the dashboard shows why a strategy helps."""

import lightning as L
import torch
from torch.distributed.tensor import DTensor

MB = 2**20


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this device holds of ``tensor``: its local shard when sharded (FSDP's DTensors)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def model_state_bytes(
    module: torch.nn.Module, optimizers: list[torch.optim.Optimizer], placement: dict[int, int] | None = None
) -> dict[str, int]:
    """Parameters, gradients and optimizer state held by the fullest device of this process.

    ``placement`` maps ``id(parameter)`` to the device (stage) holding it, for a process that drives several
    (``strategy=model_parallel``); by default the process has one device.
    """
    placement = placement or {}
    per_device: dict[int, dict[str, int]] = {}

    def add(parameter: torch.Tensor, part: str, tensor: torch.Tensor) -> None:
        sizes = per_device.setdefault(placement.get(id(parameter), 0), {"params": 0, "grads": 0, "optimizer": 0})
        sizes[part] += local_bytes(tensor)

    for parameter in module.parameters():
        add(parameter, "params", parameter)
        if parameter.grad is not None:
            add(parameter, "grads", parameter.grad)
    for optimizer in optimizers:
        for parameter, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    add(parameter, "optimizer", value)
    return max(per_device.values(), key=lambda sizes: sum(sizes.values()))


class DeviceMemory(L.Callback):
    """Logs ``memory/{params,grads,optimizer,model_state}_mb`` and, on CUDA, ``memory/peak_{allocated,reserved}_mb``.

    Each value is the maximum over devices: the device that runs out first is the one that matters. Model state
    is measured just before each optimizer step, when gradients exist (Lightning frees them after the step), and
    the epoch's last measurement is logged; CUDA peaks cover the epoch, validation included.
    """

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        placement = getattr(trainer.strategy, "parameter_stage", None)
        self._sizes = model_state_bytes(pl_module, trainer.optimizers, placement)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        sizes = dict(self._sizes)
        sizes["model_state"] = sum(sizes.values())
        if pl_module.device.type == "cuda":
            sizes["peak_allocated"] = torch.cuda.max_memory_allocated(pl_module.device)
            sizes["peak_reserved"] = torch.cuda.max_memory_reserved(pl_module.device)
        for name, size in sizes.items():
            pl_module.log(f"memory/{name}_mb", size / MB, sync_dist=True, reduce_fx="max")
