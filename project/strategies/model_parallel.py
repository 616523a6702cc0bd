"""``strategy=model_parallel``: the model's blocks split into stages on several devices, driven by one process; the
layout is ``project.layouts.model_parallel_layout``'s. Stages go on ``cuda:0 .. cuda:devices-1`` in turn; on a
CPU-only machine every stage sits on the CPU and the same code runs.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import SingleDeviceStrategy

from project.layouts.model_parallel_layout import ModelParallelLayout
from project.models.sequence import BlockSequence
from project.options.option_types import PositiveInt
from project.parallel.parallelize import stage_modules
from project.strategies.laid_out import LaidOutStrategy


class ManualModelParallelStrategy(SingleDeviceStrategy, LaidOutStrategy):
    """``num_stages`` stages on ``devices`` devices; the loss is computed on the last stage's device.

    The root device (where Lightning puts batches, metrics and the loss) is the last stage's, so targets and
    outputs meet there; inputs are moved to the first stage by the stage hooks.
    """

    layout: ModelParallelLayout

    def __init__(
        self, num_stages: PositiveInt, devices: PositiveInt, blocks_per_stage: Sequence[PositiveInt] | None = None
    ) -> None:
        super().__init__(device="cpu")
        split = tuple(blocks_per_stage) if blocks_per_stage is not None else None
        self.layout = ModelParallelLayout(num_stages, split)
        self.num_stage_devices = devices
        self._parameter_stage: dict[int, int] = {}
        self._staged_model: BlockSequence | None = None

    def stage_device(self, stage: int) -> torch.device:
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", stage % self.num_stage_devices)
        return torch.device("cpu")

    @property
    def stage_devices(self) -> list[torch.device]:
        return [self.stage_device(stage) for stage in range(self.layout.num_stages)]

    @property
    def root_device(self) -> torch.device:
        return self.stage_device(self.layout.num_stages - 1)

    def parallelize(self, model: BlockSequence) -> None:
        """Each stage allocated on its own device, never the whole model on one."""
        if self._staged_model is not None:
            return  # already split
        stages = self.layout.lay_out(model, self.stage_devices)
        self._parameter_stage = {
            id(parameter): stage
            for stage in range(self.layout.num_stages)
            for module in stage_modules(model, stages, stage)
            for parameter in module.parameters()
        }
        self._staged_model = model

    def clip_grad_norm_(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor | None:
        return None  # Lightning's: one process holds every stage's gradients

    @property
    def parameter_stage(self) -> dict[int, int]:
        return self._parameter_stage

    def model_to_device(self) -> None:
        # The stages are on their devices already; everything else (metrics, buffers) goes to the root device.
        assert self.model is not None  # (as in Lightning's own model_to_device)
        for child in self.model.children():
            if child is not self._staged_model:
                child.to(self.root_device)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        # Lightning's version moves all optimizer state to the root device; here it must stay with each
        # parameter's stage, which ``Optimizer.load_state_dict`` already does.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
