"""The typed job every stage after the config checks reads (``Job``): its layout of the devices (``Layout``,
``project.job.layout``), its model (``Model``: the net's and the task module's constructors, the model options among
the latter's arguments, ``project.job.model_option``) and the figures every later stage reads. The config becomes a
job once (``project.config.checks.check_config``); the memory plan and ``plan=search`` make the jobs they try from it
with ``dataclasses.replace`` (``Change``), never from a config again."""

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from pathlib import Path
from typing import Any, cast

import torch

from project.data.datamodule import DataShape
from project.job.cluster import Cluster
from project.job.layout import Layout
from project.job.model_option import Target
from project.job.task import Generation, TaskModule
from project.models.sequence import BlockSequence
from project.options.errors import built
from project.options.option_types import PositiveInt
from project.parallel.dims import ParallelDims
from project.parallel.parallelize import Checkpointing, checkpointing_setting


@dataclass(frozen=True)
class SearchSettings:
    """``plan_search``: the strategy options ``plan=search`` lays out, its deepest pipeline, and whether it leaves
    out the layouts its bound shows slower than the fastest that fits."""

    strategies: Sequence[str]  # a tuple (``build_job``); in the config, a list
    max_pipeline_ranks: PositiveInt
    prune: bool


@dataclass(frozen=True)
class ValidationSchedule:
    """When a run validates and how much of an epoch it trains: ``trainer.val_check_interval``,
    ``trainer.check_val_every_n_epoch`` and ``trainer.limit_train_batches`` (Lightning's meanings)."""

    val_check_interval: int | float | None
    check_val_every_n_epoch: int | None
    limit_train_batches: int | float | None


class Setting(Enum):
    """What a change the planner tries can set, each a key a user types (``project.config.build.overrides``), in
    the order a suggestion names them."""

    STRATEGY = auto()
    NUM_STAGES = auto()
    MICROBATCHES = auto()
    SCHEDULE = auto()
    STAGES_PER_RANK = auto()
    TENSOR_PARALLEL_SIZE = auto()
    EXPERT_PARALLEL_SIZE = auto()
    DEVICES = auto()
    NODES = auto()
    BATCH_SIZE = auto()
    ACCUMULATE = auto()
    ACTIVATION_CHECKPOINTING = auto()


@dataclass(frozen=True)
class Change:
    """A job the planner tries (``job``), made from another with ``dataclasses.replace``, and the settings it
    changes (``sets``): what a suggestion of it names."""

    job: "Job"
    sets: frozenset[Setting]


# The last few models meta_model built, by their net's and module's constructors and depth: plan=search checks dozens
# of layouts of one model, and building Llama 3.1 8B's 32 blocks, even on the meta device, was most of a check. The
# rules only read them.
_META_MODELS: dict[tuple[Any, ...], tuple[BlockSequence, TaskModule]] = {}
_META_MODELS_KEPT = 3


@dataclass(frozen=True)
class Model:
    """The model a job trains (``model``), typed once (``project.config.build.model_of``): its net's and its task
    module's constructors with their options (the model options among the module's), and apart from them what the
    planner changes or reads: the net's depth, activation checkpointing and compilation."""

    name: str  # the option chosen in the model group (what the plan's header names)
    net: functools.partial  # the net's class and model.net's options, but num_layers
    module: functools.partial  # the task module's class and model's options, but the net and the fields below
    num_layers: int | None  # the net's blocks, where they are all alike (model.net.num_layers)
    activation_checkpointing: Checkpointing  # the model's own (model.activation_checkpointing)
    compile: bool  # model.compile: each block, and the loss of the logits, under torch.compile

    def meta_net(self) -> BlockSequence:
        """The plain model on the meta device: shapes only, no memory."""
        depth = {} if self.num_layers is None else {"num_layers": self.num_layers}
        with torch.device("meta"):
            return self.net(**depth)

    def meta_model(self) -> tuple[BlockSequence, TaskModule]:
        """The net and its task module on the meta device (shapes only, nothing allocated), the model options built
        on it, built once per model. An error building either is ``model.net``'s or ``model``'s (the task module
        checks its own options: optimizer, schedule, the model options' targets)."""
        key = (self.net, self.num_layers, self.module)
        if key not in _META_MODELS:
            net = built("model.net", self.meta_net)
            with torch.device("meta"):
                module = built("model", lambda: self.new_module(net))
            while len(_META_MODELS) >= _META_MODELS_KEPT:
                del _META_MODELS[next(iter(_META_MODELS))]
            _META_MODELS[key] = net, module
        return _META_MODELS[key]

    @property
    def task(self) -> type[TaskModule]:
        """The task module's class."""
        return cast(type[TaskModule], self.module.func)

    def new_module(self, net: BlockSequence) -> TaskModule:
        """The task module around ``net``, its model options built on it (``ModelOption.build``)."""
        return self.module(
            net=net,
            activation_checkpointing=checkpointing_setting(self.activation_checkpointing),
            compile=self.compile,
        )


@dataclass(frozen=True)
class Job:
    """A run, checked and typed (``project.config.checks.check_config``): its layout, its model, and the figures every
    later stage reads. The world size, the data-parallel replicas and the global batch are computed here alone."""

    layout: Layout
    model: Model
    strategy_name: str  # the option chosen in the strategy group
    devices: int  # per node
    nodes: int
    batch_size: int  # samples per data-parallel replica per step (data.batch_size)
    accumulate: int  # batches per optimizer step (trainer.accumulate_grad_batches)
    precision: str  # Lightning's name for it: 32-true, bf16-mixed...
    accelerator: str  # trainer.accelerator
    uses_cuda: bool  # whether it trains on CUDA GPUs (accelerator gpu, or auto on a machine with them)
    data: DataShape  # the rows a training step runs (``TaskModule.step_shape``)
    generation: Generation | None  # what the task draws inside each step (``TaskModule.generation``), or None
    train_samples: int
    val_samples: int
    validation: ValidationSchedule
    text_sample_prompt: str | None  # the key of a text sample's prompt (callbacks.<name>.prompt), where one is set
    ckpt_path: str | None  # the checkpoint this run loads, resolved (ckpt_path=last and auto made a path or None)
    cluster: Cluster | None  # the GPU nodes it is planned for (``cluster``)
    device_memory_gb: float | None  # memory_plan.device_memory_gb
    if_over: str  # memory_plan.if_over: error or warn
    step_checks: str  # when the host reads each step's flags: each_step (it waits for the device), a_step_late, auto
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
        return self.uses_cuda or (self.cluster is not None and self.cluster.kind == "gpu")

    @property
    def activation_checkpointing(self) -> Checkpointing:
        """The model's activation checkpointing, or else the layout's own (FSDP's)."""
        own = self.model.activation_checkpointing
        return own if own != "off" else self.layout.activation_checkpointing

    @property
    def seq_length(self) -> int | None:
        """Tokens per sequence; None for data without a sequence."""
        return self.data.seq_length

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
        return self.batch_size * self.data.sequences_per_sample * (self.seq_length or 1)

    @property
    def target(self) -> Target:
        """What the job's model options prepare its net for: its GPUs, its data-parallel ranks sharding it or not."""
        return Target(cuda=self.on_gpus, sharded=self.dims.shard and self.dims.data_parallel > 1)

    def meta_net(self) -> BlockSequence:
        """The plain model on the meta device: shapes only, no memory."""
        return self.model.meta_net()

    def new_module(self) -> TaskModule:
        """The job's LightningModule around a fresh meta-device net, prepared as ``configure_model`` prepares it on the
        job's devices (its model options, then activation checkpointing; each layout then cuts or shards its own
        copy)."""
        module = self.model.new_module(self.meta_net())
        module.prepare_net(self.target)
        return module

    def simulation_key(self) -> str:
        """A digest of what a simulation of this job reads (its model, data, layout, devices, batch and precision),
        the same in every process: ``plan=search``'s cache key."""
        simulated = {
            "model": stable(self.model),
            "data": stable(self.data),
            "generation": stable(self.generation),
            "layout": stable(self.layout),
            "figures": [self.devices, self.nodes, self.batch_size, self.accumulate, self.precision, self.on_gpus],
        }
        return hashlib.sha256(json.dumps(simulated, sort_keys=True).encode()).hexdigest()


def stable(value: Any) -> Any:
    """``value`` as JSON that reads the same in every process: a dataclass as its class and the fields it is built
    from, a partial as its callable and arguments, a class or function by its qualified name."""
    if isinstance(value, functools.partial):
        keywords = {name: stable(argument) for name, argument in sorted(value.keywords.items())}
        return {"call": stable(value.func), "args": stable(value.args), "keywords": keywords}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {field.name: stable(getattr(value, field.name)) for field in dataclasses.fields(value) if field.init}
        return {"class": stable(type(value)), **fields}
    if isinstance(value, (list, tuple)):
        return [stable(item) for item in value]
    if isinstance(value, dict):
        return {str(key): stable(item) for key, item in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, type) or callable(value):
        return f"{value.__module__}.{value.__qualname__}"
    return repr(value)  # torch.dtype, and the like: their repr names them
