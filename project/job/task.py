"""The contract of a task (``TaskModule``, the LightningModule of ``project/tasks/``, which sits above the layers that
use it): a batch is its data's ``(inputs, target)``, the model's outputs and that target make one ``Loss``, and every
caller goes through it: Lightning's steps, a pipeline's micro-batches, the memory plan's simulated step. And what a
task computes once per run before its first step (``Precomputation``), which the plan prices."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import lightning as L
import torch
from torch import nn

from project.data.datamodule import DataShape
from project.job.model_option import ModelOption, Target
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError

if TYPE_CHECKING:  # a job holds the task module's constructor, and the task's rules take the job: the types only
    from project.job.job import Job

# A metric's share of a batch: the sum of its values and how many values were summed (samples, tokens, pairs).
MetricSums = dict[str, tuple[torch.Tensor, torch.Tensor | int]]


@dataclass(frozen=True)
class Loss:
    """A batch's (or micro-batch's) loss: ``value``, what is backpropagated, and ``metric_sums``, its share of each
    epoch metric (``MetricSums``), computed only where the caller meters it (not in a pipeline's unmetered calls, nor
    in the memory plan's simulated step)."""

    value: torch.Tensor
    metric_sums: Callable[[], MetricSums]


@dataclass(frozen=True)
class Precomputation:
    """What a task computes once per run before its first step (``TaskModule.precomputation``): the criterion's
    value of each row of every sample, training's and validation's, under the net as it starts, forward only (DPO's
    reference log-probabilities: TRL's ``precompute_ref_log_probs``). Its cost is a forward pass over every sample
    (``samples_forward``), which the step-time model prices; its values are kept in the checkpoints with the data's
    fingerprint under ``checkpoint_key`` and ``fingerprint_key``. ``task``, ``name``, ``values`` and ``sample`` say
    what they are in the log and in errors: "DPO", "reference", "log-probabilities", "pair"."""

    task: str
    name: str
    values: str
    sample: str
    checkpoint_key: str
    fingerprint_key: str

    @staticmethod
    def samples_forward(train_samples: int, val_samples: int) -> int:
        """The samples the pass runs forward, of a data set of ``train_samples`` and ``val_samples``: every one."""
        return train_samples + val_samples


@dataclass(frozen=True)
class Generation:
    """What a task draws from its model inside each training step, before the step's forward (GRPO's completions),
    which the plan simulates and prices: for each prompt of a replica's batch, ``sequences`` completions drawn
    together after a prompt of at most ``prompt_tokens`` tokens, each of at most ``new_tokens``: the prompt's pass
    over the group's rows, then passes of one token a row over a key/value cache, the model's FSDP units gathered
    once for the whole draw (``project.models.generation.sample_group``). With ``reference_pass``, then a forward
    without gradient over the step's rows (GRPO's KL reference, ``beta`` > 0), the FSDP units gathered for it."""

    sequences: int
    prompt_tokens: int
    new_tokens: int
    reference_pass: bool = False


class TaskModule(Protocol):
    """What the strategies, the layouts, the memory plan and the job's rules use of a task's LightningModule
    (``project.tasks.base.TrainingModule``), for type checking."""

    net: BlockSequence
    options: list[ModelOption]  # the model options that are on, in their declared order
    precomputation: ClassVar[Precomputation | None]
    precomputed: torch.Tensor | None  # its values, once computed or read from a checkpoint

    @property
    def trainer(self) -> L.Trainer: ...

    def prepare_net(self, target: Target) -> None: ...

    def new_optimizer(self) -> torch.optim.Optimizer: ...

    def parameter_groups(self) -> list[list[str]]: ...

    def compiled_loss_module(self) -> nn.Module | None: ...

    def net_outputs(self, last: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> Loss: ...

    def meter(self, split: str, loss: Loss) -> None: ...

    def log_metrics(self, split: str) -> None: ...

    def problem(self, job: "Job") -> ConfigError | None: ...

    def step_shape(self, shape: DataShape) -> DataShape: ...

    def generation(self, shape: DataShape) -> Generation | None: ...

    def keep_initial_weights(self) -> list[torch.Tensor]: ...
