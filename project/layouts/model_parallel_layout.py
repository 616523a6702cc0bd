"""``strategy=model_parallel``: the model's blocks split into stages on several devices, driven by one process.

Seed 002's picture: GPU 1 holds the first layers, GPU 2 the next, and activations travel from one to the next.
Every device holds only its stage's parameters, gradients and optimizer state, but only one device works at a time
(``strategy=pipeline`` fills that bubble with micro-batches).
"""

from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from project.job.job import Change, Job, Setting
from project.job.layout import DeviceWork, Layout
from project.layouts.stage_split import stage_split_problem, staged_at_depth
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.parallel.dims import ParallelDims
from project.parallel.parallelize import (
    block_inputs,
    block_sizes,
    connect_stages,
    keep_only,
    place_stages,
    split_blocks,
    stage_modules,
)


@dataclass(frozen=True)
class ModelParallelLayout(Layout):
    """``num_stages`` stages, of ``blocks_per_stage`` blocks each (None: balanced by parameters), on the devices of
    one process."""

    num_stages: int
    blocks_per_stage: tuple[int, ...] | None = None

    def stages(self, net: BlockSequence) -> list[range]:
        """Each stage's block indices."""
        return split_blocks(block_sizes(net), self.num_stages, self.blocks_per_stage)

    def lay_out(self, model: BlockSequence, devices: Sequence[torch.device]) -> list[range]:
        """Allocate each stage of ``model`` (on the meta device) on its own device, never the whole model on one,
        and make each stage move its incoming activations there; returns the stages."""
        stages = self.stages(model)
        place_stages(model, stages, devices)
        connect_stages(model, stages, devices)
        return stages

    def processes_per_node(self, devices: int) -> int:
        return 1  # one process drives every stage

    def dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(world_size)

    @property
    def saves_sharded_checkpoints(self) -> bool:
        return False

    def problem(self, job: Job, net: BlockSequence) -> ConfigError | None:
        return stage_split_problem(net, self.num_stages, self.blocks_per_stage)

    def simulated_devices(self, job: Job) -> Generator[DeviceWork, None, None]:
        """Each stage, holding its blocks, the activations of the whole batch through them and, after the first,
        the input that arrives from the stage before."""
        module = job.new_module()
        stages = self.stages(module.net)
        boundaries = block_inputs(module.net, job.data.example_batch(job.batch_size)[0].to("meta"))
        for stage in range(self.num_stages):
            module = job.new_module()
            kept = stage_modules(module.net, stages, stage)
            keep_only(module.net, kept)
            yield DeviceWork(
                f"stage {stage}",
                module,
                kept,
                job.batch_size,
                stage_input=boundaries[stages[stage].start] if stage else None,
                last=stage == self.num_stages - 1,
            )

    def blocks_per_device(self, net: BlockSequence) -> list[int]:
        return [len(stage) for stage in self.stages(net)]

    def at_depth(self, job: Job, blocks_per_stage: int) -> Job:
        return staged_at_depth(job, self, blocks_per_stage)

    def setting_values(self) -> dict[Setting, Any]:
        return {Setting.NUM_STAGES: self.num_stages}

    def bubble_fraction(self) -> float:
        """The stages run one after another, each device idle while the others compute."""
        return 1 - 1 / self.num_stages

    def memory_saving_changes(self, job: Job) -> Iterator[Change]:
        return iter(())  # the planner's own changes; more stages need more devices, which the strategy does not add

    def search_space(self, job: Job, global_batch: int) -> Iterator[Change]:
        return iter(())  # not among plan=search's layouts: a pipeline of the same stages is never slower
