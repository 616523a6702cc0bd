"""``strategy=tensor_parallel``: every layer split across all the devices of one replica (Megatron's tensor
parallelism on DTensor, ``TensorParallel``).

Each model's plan sits in one table (``project.parallel.tensor_parallel_plans``): attention heads and MLP units
split across the ranks, norms on each rank's share of the sequence, token embedding and output layer split by
vocabulary. The ranks of a tensor-parallel group compute the same batch together, so they count as one
data-parallel replica; more replicas are ``strategy=fsdp`` with the same ``tensor_parallel_size`` (2D), and a
pipeline splits each stage the same way (3D).
"""

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from project.job.job import Change, Job
from project.layouts.sharded_layout import ShardedLayout
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.parallel.dims import ParallelDims


@dataclass(frozen=True, kw_only=True)
class TensorParallelLayout(ShardedLayout):
    """``tensor_parallel.size`` ranks split every layer, and they are all the job's ranks: one replica."""

    def dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(world_size, tensor_parallel=self.tensor_parallel.size)

    def problem(self, job: Job, net: BlockSequence) -> ConfigError | None:
        problem = super().problem(job, net)
        size = self.tensor_parallel.size
        if problem is None and job.world_size > size:
            return ConfigError(
                "strategy.tensor_parallel_size",
                f"is {size} of the job's {job.world_size} processes; "
                "strategy=tensor_parallel runs one replica, which spans them all.",
                f"use strategy=fsdp strategy.tensor_parallel_size={size} to shard the {job.world_size // size} "
                f"replicas with FSDP, or strategy.tensor_parallel_size={job.world_size} to split every layer "
                "over all of them.",
            )
        return problem

    def lay_out(self, model: BlockSequence, mesh: DeviceMesh, precision: str) -> list[nn.Module]:
        """Each layer split over the tensor-parallel dimension."""
        self.tensor_parallel.apply(model, mesh)
        return [model]

    def bubble_fraction(self) -> float:
        return 0.0

    def memory_saving_changes(self, job: Job) -> Iterator[Change]:
        return iter(())  # at the same global batch FSDP over the same devices holds as little (the planner tries it)

    def search_space(self, job: Job, global_batch: int) -> Iterator[Change]:
        return iter(())  # not among plan=search's layouts: fsdp with tensor_parallel_size covers it
