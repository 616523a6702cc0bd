"""What this project's Lightning strategies offer beyond Lightning's ``Strategy``: their layout of the job's devices,
applied to the plain model from ``configure_model``. Lightning's own strategies (auto, DDP) keep the whole model on
every rank and offer none of it."""

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from project.job.layout import Layout
from project.models.sequence import BlockSequence

# A value per row of a batch from the net's outputs and the targets: (rows, ...), (rows, ...) -> (rows,)
RowFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class LaidOutStrategy(ABC):
    """A strategy that lays out the model itself (``project.layouts``): what ``TrainingModule`` and the callbacks ask
    of it."""

    layout: Layout

    @abstractmethod
    def parallelize(self, model: BlockSequence) -> None:
        """Lay out ``model`` (on the meta device) for this rank, before it materialises what it keeps: called from
        the LightningModule's ``configure_model``."""

    @abstractmethod
    def clip_grad_norm_(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor | None:
        """Scale the gradients to a whole-model norm of at most ``max_norm`` where Lightning's own clipping would not
        see the whole model, and return that norm; None where Lightning's clipping is right (it clips this rank's
        gradients, DTensor shards adding up over their mesh)."""

    @property
    @abstractmethod
    def parameter_stage(self) -> dict[int, int]:
        """``id(parameter)`` -> the stage (and so the device) holding it, for a process that drives several
        devices; empty where a process has one."""

    def summed_over_stages(self, counts: dict[str, int]) -> dict[str, int]:
        """``counts`` of this rank's parameters (by name), summed name by name over the ranks that hold the model's
        other stages: the model's own counts (for its summary). As they are where each rank holds every stage (a
        DTensor shard counts as its whole tensor)."""
        return counts

    def row_values(self, net: nn.Module, inputs: torch.Tensor, target: torch.Tensor, fn: RowFunction) -> torch.Tensor:
        """``fn`` of the net's outputs for ``inputs`` and of ``target``, forward only (the caller chooses the grad
        mode), the same on every rank of a replica: here each rank runs the whole net; a pipeline's ranks each run
        their stages."""
        return fn(net(inputs), target)
