"""The typed job every stage after the config checks reads (``Job``), and the two contracts it holds: each layout of
its devices (``Layout``: how the ranks divide, the rules a job is held to, what each device holds and runs in a
simulated step, and what the memory plan and ``plan=search`` may change) and each model option (``ModelOption``: its
rules, what it makes of the plain model, what it adds to training). ``project/layouts/`` holds one layout per
strategy, ``project/model_options/`` one file per option; ``project.config.checks.check_config`` builds the job from
the composed config, once."""

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchmetrics import Metric

from project.job.cluster import Cluster
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.options.option_types import PositiveInt
from project.parallel.dims import ParallelDims
from project.parallel.parallelize import Checkpointing

# What a simulation reads of a job's config: its cache key (plan=search) covers these.
SIMULATED_KEYS = ("model", "data", "strategy", "trainer")


class TaskModule(Protocol):
    """What the strategies, the layouts and the memory plan use of a task's LightningModule
    (``project.tasks.base.TrainingModule``, which sits above them), for type checking."""

    net: BlockSequence
    criterion: nn.Module
    optimizer_factory: Callable[..., torch.optim.Optimizer]
    activation_checkpointing: Checkpointing

    @property
    def trainer(self) -> L.Trainer: ...

    def example_batch(self, batch_size: int, data: DictConfig) -> tuple[torch.Tensor, torch.Tensor]: ...

    def prepare_net(self, target: "Target") -> None: ...

    def new_optimizer(self) -> torch.optim.Optimizer: ...

    def _optimizer_groups(self) -> list[dict[str, Any]]: ...

    def parameter_groups(self) -> list[list[str]]: ...

    def update_metrics(self, split: str, outputs: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None: ...

    def log_metrics(self, split: str) -> None: ...


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


# A layout's change, as the planner names and makes it: the overrides as a user types them, and the keys they set.
Change = tuple[str, dict[str, Any]]


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

    @abstractmethod
    def depth_changes(self, blocks_per_stage: int) -> dict[str, Any]:
        """The keys that give each stage (the whole net, where there are no stages) ``blocks_per_stage`` blocks: the
        shallow copies a deep model's plan is extended from (``project.plan.depth``)."""

    @abstractmethod
    def bubble_fraction(self) -> float:
        """For the step-time model: the share of a step each device waits idle (a pipeline's bubble)."""

    @abstractmethod
    def memory_saving_changes(self, job: "Job") -> Iterator[Change]:
        """For the memory plan's suggestions: the layout's own changes that lower the memory per device, the
        smallest first."""

    @abstractmethod
    def search_space(self, job: "Job", global_batch: int) -> Iterator[Change]:
        """For ``plan=search``: the layouts of this kind of ``job``'s devices, each replica taking its share of
        ``global_batch``. The run's checks then drop those the model cannot take."""


@dataclass(frozen=True)
class Target:
    """What a model option prepares the net for (``ModelOption.prepare``): CUDA GPUs (``cuda``; elsewhere float8
    matmuls are emulated), and parameters FSDP shards over data-parallel ranks (``sharded``)."""

    cuda: bool
    sharded: bool


@dataclass(frozen=True)
class InitialWeights:
    """Where a run's weights start: a Hugging Face model dir's (``model.init_from``), else drawn from ``seed``."""

    init_from: str | None
    seed: int


class ModelOption(ABC):
    """A model option (``model.<name>``: one file of ``project/model_options/``, built from its typed config): its
    rules, what it makes of the plain model, and what it adds to training. ``TrainingModule`` applies a job's
    options that are on in one declared order (``project.model_options.ORDER``), each at its hooks, and so does the
    memory plan's ``Job.new_module``; the checks and every layout the planner tries ask each for its rules. Each task
    module works on a copy of its own: an option keeps what it did to that module's net."""

    @property
    @abstractmethod
    def enabled(self) -> bool:
        """Whether the option is on. Off (its keys' off values), nothing below is asked of it."""

    def problem(self, job: "Job", net: BlockSequence) -> ConfigError | None:
        """The first of its rules ``job`` breaks (``net``: its model on the meta device, every option built), or
        None: asked before launch and of each layout the planner tries."""
        return None

    def build(self, net: BlockSequence) -> None:
        """When the task module is built: what it changes of ``net``'s parameters (on the meta device), which its
        checkpoints then name."""
        return None  # (an option that does not override a hook does nothing there)

    def prepare(self, net: BlockSequence, target: Target) -> None:
        """Before a layout acts on ``net`` (on the meta device), knowing what it runs on: what it does to its
        modules. Activation checkpointing, compilation and the layout come after."""
        return None

    def summary(self) -> str | None:
        """The line logged when training starts, saying what it did; None: nothing to say."""
        return None

    def training_loss(self, net: BlockSequence) -> torch.Tensor | None:
        """A term added to a training step's loss (not to the logged ``train/loss``), or None."""
        return None

    def epoch_metrics(self) -> dict[str, Metric]:
        """Metrics it keeps over a training epoch, by name, each computing a dict of logged values: logged at the
        epoch's end, reduced over every rank, and kept in a mid-epoch checkpoint."""
        return {}

    def before_optimizer_step(self, net: BlockSequence) -> None:
        """Before each optimizer step, its gradients in."""
        return None

    def after_optimizer_step(self, net: BlockSequence) -> None:
        """After each optimizer step (an optimizer post-step hook, which the memory plan's simulated step runs too)."""
        return None

    def on_save_checkpoint(self, checkpoint: dict[str, Any], weights: InitialWeights) -> None:
        """What it adds to, or changes in, a checkpoint being saved of a run whose weights started as ``weights``."""
        return None

    def on_load_checkpoint(self, checkpoint: dict[str, Any], weights: InitialWeights) -> None:
        """What it checks of a checkpoint being loaded (``ConfigError``: the run cannot go on from it)."""
        return None


@dataclass(frozen=True)
class SearchSettings:
    """``plan_search``: the strategy options ``plan=search`` lays out, its deepest pipeline, and whether it leaves
    out the layouts its bound shows slower than the fastest that fits."""

    strategies: Sequence[str]  # a tuple (``build_job``); in the config, a list
    max_pipeline_ranks: PositiveInt
    prune: bool


@dataclass(frozen=True)
class Job:
    """A run, checked and typed (``project.config.checks.check_config``): its config resolved (``cfg``, what builds
    the model and the data and what the workers load), its layout, and the figures every later stage reads.

    The world size, the data-parallel replicas and the global batch are computed here alone."""

    cfg: DictConfig
    layout: Layout
    model_name: str  # the options chosen in the model and strategy groups (what the plan's header names)
    strategy_name: str
    devices: int  # per node
    nodes: int
    batch_size: int  # samples per data-parallel replica per step (data.batch_size)
    accumulate: int  # batches per optimizer step (trainer.accumulate_grad_batches)
    precision: str  # Lightning's name for it: 32-true, bf16-mixed...
    uses_cuda: bool
    activation_checkpointing: Checkpointing  # the model's, or else the strategy's own (FSDP's)
    seq_length: int | None  # tokens per sample; None for data without a sequence
    num_layers: int | None  # the net's blocks, where they are all alike (model.net.num_layers)
    train_samples: int
    val_samples: int
    ckpt_path: str | None  # the checkpoint this run loads, resolved (ckpt_path=last and auto made a path or None)
    cluster: Cluster | None  # the GPU nodes it is planned for (``cluster``)
    device_memory_gb: float | None  # memory_plan.device_memory_gb
    if_over: str  # memory_plan.if_over: error or warn
    search: SearchSettings
    plan_cache: Path  # where plan=search keeps its simulations (${paths.cache_dir}/plan_cache)

    @property
    def processes_per_node(self) -> int:
        """Worker processes a node runs: one per device, or one that drives them all (the layout says)."""
        return self.layout.processes_per_node(self.devices)

    @property
    def on_gpus(self) -> bool:
        """Whether the job runs on CUDA GPUs: its trainer's accelerator, or the ``cluster`` it is planned for. Its
        memory plan then simulates CUDA's kernels (``project.plan.cuda_kernels``)."""
        return self.uses_cuda or self.cluster is not None

    @property
    def compile(self) -> bool:
        """Whether the model's blocks run under ``torch.compile`` (``model.compile``)."""
        return bool(self.cfg.model.get("compile", False))

    @property
    def world_size(self) -> int:
        """The job's processes: each node's, over every node."""
        return self.processes_per_node * self.nodes

    @property
    def dims(self) -> ParallelDims:
        return self.layout.dims(self.world_size)

    @property
    def samples_per_step(self) -> int:
        """Samples per training step, over every replica: a replica's batch x replicas."""
        return self.batch_size * self.dims.data_parallel

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: the samples of a step x gradient accumulation."""
        return self.samples_per_step * self.accumulate

    @property
    def tokens_per_step(self) -> int:
        """Tokens (or samples, for data without a sequence) one data-parallel replica trains in a step."""
        return self.batch_size * (self.seq_length or 1)

    def meta_net(self) -> BlockSequence:
        """The plain model on the meta device: shapes only, no memory."""
        with torch.device("meta"):
            return instantiate(self.cfg.model.net)

    @property
    def target(self) -> Target:
        """What the job's model options prepare its net for: its GPUs, its data-parallel ranks sharding it or not."""
        return Target(cuda=self.on_gpus, sharded=self.dims.shard and self.dims.data_parallel > 1)

    def new_module(self) -> TaskModule:
        """The job's LightningModule around a fresh meta-device net, prepared as ``configure_model`` prepares it on the
        job's devices (its model options, then activation checkpointing; each layout then cuts or shards its own
        copy)."""
        module = instantiate(self.cfg.model, net=self.meta_net())
        module.prepare_net(self.target)
        return module

    def example_batch(self, module: TaskModule, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of ``batch_size`` samples of the shapes and dtypes the job's data feeds ``module``."""
        return module.example_batch(batch_size, self.cfg.data)

    def simulated_config(self) -> str:
        """What a simulation of this job reads of its config (the keys of ``SIMULATED_KEYS``), resolved, as JSON; the
        job's own dir (in ``trainer.default_root_dir``: each run has its own) left out."""
        simulated = {key: OmegaConf.to_container(self.cfg[key], resolve=True) for key in SIMULATED_KEYS}
        return json.dumps(simulated, sort_keys=True, default=str).replace(str(self.cfg.paths.output_dir), "<job>")
