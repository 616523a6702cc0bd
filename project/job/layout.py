"""The contract each layout of a job's devices declares (``Layout``, one per strategy in ``project/layouts/``): how
the ranks divide, the rules a job is held to, what each device holds and runs in a simulated step (``DeviceWork``),
and what the memory plan and ``plan=search`` may change."""

from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from project.job.task import TaskModule
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.parallel.dims import ParallelDims
from project.parallel.parallelize import Checkpointing

if TYPE_CHECKING:  # a job holds its layout, and a layout's rules and changes take and make jobs: the types only
    from project.job.job import Change, Job, Setting


@dataclass
class DeviceWork:
    """What one simulated device holds and runs in a training step, as its layout lays it out.

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
    forward_in_backward: bool = False  # a pipeline: the schedule runs the forwards after Lightning's zero_grad
    grads_persist: bool = False  # DDP with gradient_as_bucket_view: gradients live in its buckets throughout
    extra_buffer_bytes: int = 0  # held throughout besides (DDP's buckets, when gradients are not views of them)
    loss_parallel: bool = False  # logits split by vocabulary across tensor-parallel ranks: torch's loss_parallel
    unsimulated_collectives: dict[str, int] = field(default_factory=dict)  # bytes by Link key of the step's
    # collectives the simulation does not run (DDP's all-reduce of the gradients, made by its wrapper; what a
    # pipeline rank sends to the ranks of its neighbouring stages)...
    unsimulated_calls: dict[str, int] = field(default_factory=dict)  # ...and how many of each


class Layout(ABC):
    """How a job's devices divide its work: declared by each strategy's layout (``project/layouts/``), read by the
    checks, the memory plan, the step-time model and ``plan=search``, and applied to the model by the strategy."""

    @abstractmethod
    def processes_per_node(self, devices: int) -> int:
        """Processes a node runs for its ``devices``: one per device, or one that drives them all."""

    @abstractmethod
    def dims(self, world_size: int) -> ParallelDims:
        """How ``world_size`` ranks divide: pipeline x data parallel x tensor parallel."""

    @property
    @abstractmethod
    def saves_sharded_checkpoints(self) -> bool:
        """Whether each rank saves and loads its own part of a checkpoint (a dir), rather than a single file."""

    @abstractmethod
    def problem(self, job: "Job", net: BlockSequence) -> ConfigError | None:
        """The first of the layout's own rules that ``job`` breaks (``net``: its model on the meta device), or
        None: checked before launch, and asked of each layout the planner tries."""

    @abstractmethod
    def simulated_devices(self, job: "Job") -> Generator[DeviceWork, None, None]:
        """For the memory plan: each device of ``job`` whose memory differs, laid out as a real run lays it out
        (over torch's fake process group where the layout needs ranks)."""

    @abstractmethod
    def blocks_per_device(self, net: BlockSequence) -> list[int]:
        """Blocks each of the simulated devices runs, in order."""

    def at_depth(self, job: "Job", blocks_per_stage: int) -> "Job":
        """``job`` with each stage (the whole net, where there are no stages) ``blocks_per_stage`` blocks deep: the
        shallow copies a deep model's plan is extended from (``project.plan.depth``)."""
        return replace(job, model=replace(job.model, num_layers=blocks_per_stage))

    @abstractmethod
    def bubble_fraction(self) -> float:
        """For the step-time model: the share of a step each device waits idle (a pipeline's bubble)."""

    @abstractmethod
    def memory_saving_changes(self, job: "Job") -> Iterator["Change"]:
        """For the memory plan's suggestions: the layout's own changes that lower the memory per device, the
        smallest first."""

    @abstractmethod
    def search_space(self, job: "Job", global_batch: int) -> Iterator["Change"]:
        """For ``plan=search``: the layouts of this kind of ``job``'s devices, each replica taking its share of
        ``global_batch``. The run's checks then drop those the model cannot take."""

    def setting_values(self) -> dict["Setting", Any]:
        """The values of the layout's own settings a change can set (``Setting``: its stages, micro-batches,
        tensor-parallel size...), by setting."""
        return {}

    def wraps_one_rank(self, job: "Job") -> bool:
        """Whether FSDP wraps the model where its data-parallel dimension is one rank: it shards nothing there, and
        a layout wraps it only to offload parameters to the CPU."""
        return False

    @property
    def activation_checkpointing(self) -> Checkpointing:
        """The layout's own activation checkpointing (FSDP's ``strategy.activation_checkpointing``), which the
        model's overrides where it is on; off for a layout that has none."""
        return "off"

    def with_activation_checkpointing(self, mode: Checkpointing) -> "Layout":
        """This layout with its own activation checkpointing ``mode``; itself where it has none."""
        return self
