"""The contract every model option declares (``ModelOption``: one file each in ``project/model_options/``): its rules,
what it makes of the plain model and when, and what it adds to training; and what its hooks are given (``Target``:
what the net is prepared for, ``InitialWeights``: where a run's weights start)."""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torchmetrics import Metric

from project.models.sequence import BlockSequence
from project.options.errors import ConfigError

if TYPE_CHECKING:  # a job holds its model's options: the type only, to check the rules' signature
    from project.job.job import Job


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

    def notice(self, net: BlockSequence) -> str | None:
        """A line warned before launch where the option's settings are legal but almost surely not meant (asked of
        an option that is off too; ``net``: the model on the meta device, the options that are on built on it);
        None: nothing to say."""
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

    def after_weights_change(self, net: BlockSequence) -> None:
        """After the trained weights change: each optimizer step (an optimizer post-step hook, which the memory plan's
        simulated step runs too), and a task's exchange of them for others (GRPO's reference with full weights)."""
        return None

    def on_save_checkpoint(self, checkpoint: dict[str, Any], weights: InitialWeights) -> None:
        """What it adds to, or changes in, a checkpoint being saved of a run whose weights started as ``weights``."""
        return None

    def on_load_checkpoint(self, checkpoint: dict[str, Any], weights: InitialWeights) -> None:
        """What it checks of a checkpoint being loaded (``ConfigError``: the run cannot go on from it)."""
        return None
