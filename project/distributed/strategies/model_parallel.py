"""``strategy=model_parallel``: the model's blocks split into stages on several devices, driven by one process.

Seed 002's picture: GPU 1 holds the first layers, GPU 2 the next, and activations travel from one to the next.
Every device holds only its stage's parameters, gradients and optimizer state, but only one device works at a time
(``strategy=pipeline`` fills that bubble with micro-batches). Stages go on ``cuda:0 .. cuda:devices-1`` in turn;
on a CPU-only machine every stage sits on the CPU and the same code runs.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import SingleDeviceStrategy
from omegaconf import DictConfig

from project.config.option_types import PositiveInt
from project.distributed.parallelize import (
    block_sizes,
    connect_stages,
    keep_only,
    place_stages,
    split_blocks,
    stage_modules,
)
from project.distributed.strategies.stages import check_stage_split
from project.memory.simulation import DeviceWork, TaskModule, block_inputs
from project.models.sequence import BlockSequence


class ManualModelParallelStrategy(SingleDeviceStrategy):
    """``num_stages`` stages on ``devices`` devices; the loss is computed on the last stage's device.

    The root device (where Lightning puts batches, metrics and the loss) is the last stage's, so targets and
    outputs meet there; inputs are moved to the first stage by the stage hooks.
    """

    def __init__(
        self, num_stages: PositiveInt, devices: PositiveInt, blocks_per_stage: Sequence[PositiveInt] | None = None
    ) -> None:
        super().__init__(device="cpu")
        self.num_stages = num_stages
        self.num_stage_devices = devices
        self.blocks_per_stage = list(blocks_per_stage) if blocks_per_stage is not None else None
        self.stages: list[range] = []
        self.parameter_stage: dict[int, int] = {}  # id(parameter) -> stage, for per-device memory accounting

    @classmethod
    def check_config(cls, cfg: DictConfig, net: BlockSequence, ckpt_path: str | None) -> None:
        """Rules checked before launch (``project.config.checks``)."""
        check_stage_split(cfg, net)

    @classmethod
    def blocks_per_device(cls, cfg: DictConfig, net: BlockSequence) -> list[int]:
        """Blocks each stage's device runs (the memory plan's devices, in order)."""
        strategy = cfg.strategy
        return [len(stage) for stage in split_blocks(block_sizes(net), strategy.num_stages, strategy.blocks_per_stage)]

    @classmethod
    def bubble_fraction(cls, cfg: DictConfig) -> float:
        """For the step-time model: the stages run one after another, each device idle while the others
        compute."""
        return 1 - 1 / cfg.strategy.num_stages

    @classmethod
    def simulated_devices(cls, cfg: DictConfig, new_module: Callable[[], TaskModule]) -> Iterator[DeviceWork]:
        """For the memory plan: each stage, holding its blocks, the activations of the whole batch through them
        and, after the first, the input that arrives from the stage before."""
        strategy = cfg.strategy
        module = new_module()
        stages = split_blocks(block_sizes(module.net), strategy.num_stages, strategy.blocks_per_stage)
        example = module.example_batch(cfg.data.batch_size, cfg.data)[0].to("meta")
        boundaries = block_inputs(module.net, example)
        for stage in range(strategy.num_stages):
            module = new_module()
            kept = stage_modules(module.net, stages, stage)
            keep_only(module.net, kept)
            yield DeviceWork(
                f"stage {stage}",
                module,
                kept,
                cfg.data.batch_size,
                stage_input=boundaries[stages[stage].start] if stage else None,
                last=stage == strategy.num_stages - 1,
            )

    def stage_device(self, stage: int) -> torch.device:
        if isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", stage % self.num_stage_devices)
        return torch.device("cpu")

    @property
    def stage_devices(self) -> list[torch.device]:
        return [self.stage_device(stage) for stage in range(self.num_stages)]

    @property
    def root_device(self) -> torch.device:
        return self.stage_device(self.num_stages - 1)

    def parallelize(self, model: BlockSequence) -> None:
        """Called from the LightningModule's ``configure_model`` with its plain (meta) model: each stage is
        allocated on its own device, never the whole model on one."""
        if self.stages:
            return  # already split
        self.stages = split_blocks(block_sizes(model), self.num_stages, self.blocks_per_stage)
        place_stages(model, self.stages, self.stage_devices)
        connect_stages(model, self.stages, self.stage_devices)
        self.parameter_stage = {
            id(parameter): stage
            for stage in range(self.num_stages)
            for module in stage_modules(model, self.stages, stage)
            for parameter in module.parameters()
        }
        self._staged_model = model

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
