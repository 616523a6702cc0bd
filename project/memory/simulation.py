"""What the memory plan and the strategies share to simulate a device: the work one device does in a step
(``DeviceWork``, which each strategy's ``simulated_devices`` yields), torch's fake process group (meshes of any size
in this one process), and the shapes that cross stage boundaries. Below both the strategies and the plan."""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import lightning as L
import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.tensor._redistribute import _gen_transform_infos
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from project.models.sequence import BlockSequence


class TaskModule(Protocol):
    """What the strategies and the memory plan use of a task's LightningModule (``project.tasks.base.TrainingModule``,
    which sits above them), for type checking."""

    net: BlockSequence
    criterion: nn.Module
    optimizer_factory: Callable[..., torch.optim.Optimizer]

    @property
    def trainer(self) -> L.Trainer: ...

    def example_batch(self, batch_size: int, data: DictConfig) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _optimizer_groups(self) -> list[dict[str, Any]]: ...

    def update_metrics(self, split: str, outputs: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None: ...

    def log_metrics(self, split: str) -> None: ...


@dataclass
class DeviceWork:
    """What one simulated device holds and runs in a training step, as its strategy lays it out.

    ``module`` is the LightningModule whose ``net`` (on the meta device, already sharded or cut to this device's
    part) the device holds; ``stages`` are the parts of it the device runs, in order. A step runs ``microbatches``
    micro-batches of ``microbatch_size`` samples, at most ``in_flight`` of them between their forward and backward
    (a pipeline's schedule: GPipe all, 1F1B the stages still ahead).
    """

    name: str  # how the plan names the device: "rank 0", "stage 1"
    module: TaskModule
    stages: list[nn.Module]
    microbatch_size: int
    microbatches: int = 1
    in_flight: int = 1
    stage_input: torch.Tensor | None = None  # meta tensor of one micro-batch's input, when it comes from another
    # device (a later stage) rather than from the data
    stage_output: torch.Tensor | None = None  # meta tensor of one micro-batch's output, when another device takes it
    last: bool = True  # holds the head: computes the loss
    receive_buffers: bool = False  # a pipeline stage: a buffer per micro-batch for its inputs and output gradients
    keeps_outputs: bool = False  # a pipeline's last stage: every micro-batch's outputs, merged for the metrics
    forward_in_backward: bool = False  # a pipeline: the schedule runs the forwards after Lightning's zero_grad
    grads_persist: bool = False  # DDP with gradient_as_bucket_view: gradients live in its buckets throughout
    extra_buffer_bytes: int = 0  # held throughout besides (DDP's buckets, when gradients are not views of them)
    loss_parallel: bool = False  # logits split by vocabulary across tensor-parallel ranks: torch's loss_parallel
    unsimulated_collectives: dict[str, int] = field(default_factory=dict)  # bytes by Link key of the step's
    # collectives the simulation does not run (DDP's all-reduce of the gradients, made by its wrapper; what a
    # pipeline rank sends to the ranks of its neighbouring stages)


@contextmanager
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """torch's fake backend as the default process group: collectives return at once with outputs of the right
    shape, so meshes and sharding of any size can be built in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a memory plan needs this process free of a process group")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor caches its sharding decisions, meshes included, keyed by meshes that compare equal whatever the
        # rank and process groups (torch 2.13): the next simulated rank would run its collectives in this one's
        # groups, which are gone.
        _clear_sharding_prop_cache()
        _gen_transform_infos.cache_clear()


def block_inputs(net: BlockSequence, inputs: torch.Tensor) -> list[torch.Tensor]:
    """The meta tensors entering each block and the head, in order, for ``inputs`` (a meta tensor): the shapes a
    stage boundary carries."""
    seen: list[torch.Tensor] = []
    with torch.no_grad():
        x = net.stem(inputs)
        for block in net.blocks:
            seen.append(x)
            x = block(x)
        seen.append(x)
    return seen
