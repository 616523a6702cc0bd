"""``strategy=fsdp``: FSDP2 (``fully_shard``) per block over the data-parallel ranks, optionally inside groups of
``tensor_parallel_size`` ranks that each split every layer (2D), and with a mixture's experts split over groups of
``expert_parallel_size`` data-parallel ranks, in torchtitan's order: tensor parallelism, expert parallelism,
activation checkpointing, then FSDP. The model's own activation checkpointing and compilation (``model.*``) wrap
the blocks before the layout acts."""

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from project.job.job import Change, Job, Setting
from project.layouts.sharded_layout import ShardedLayout, expert_parallel_problem
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.parallel.dims import DATA_PARALLEL, EXPERT, EXPERT_SHARD, ParallelDims, divisors
from project.parallel.expert_parallel import (
    apply_expert_parallel,
    expert_counts,
    expert_parallel_sizes,
)
from project.parallel.parallelize import (
    Checkpointing,
    apply_activation_checkpointing,
    apply_fsdp,
    fsdp_param_dtype,
)


@dataclass(frozen=True, kw_only=True)
class FSDPLayout(ShardedLayout):
    """Fully sharded data parallel: parameters, gradients and optimizer state split across the data-parallel ranks
    (all of them, or the groups of ``tensor_parallel.size`` ranks that each split every layer)."""

    reshard_after_forward: bool = True
    activation_checkpointing: Checkpointing = "off"  # the strategy's own (strategy.activation_checkpointing)
    cpu_offload: bool = False
    reduce_dtype: torch.dtype = torch.float32
    expert_parallel: int = 1  # data-parallel ranks that split a mixture's experts (strategy.expert_parallel_size)

    def dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(
            world_size, tensor_parallel=self.tensor_parallel.size, shard=True, expert_parallel=self.expert_parallel
        )

    def problem(self, job: Job, net: BlockSequence) -> ConfigError | None:
        problem = super().problem(job, net)
        if problem is None and self.cpu_offload and not job.uses_cuda:
            return ConfigError(
                "strategy.cpu_offload",
                "moves parameter shards from GPU to CPU memory, but this run has no GPU.",
                "set strategy.cpu_offload=false, or run on GPUs (trainer.accelerator=gpu).",
            )
        return problem or expert_parallel_problem(job, net, self.expert_parallel, self.tensor_parallel.size)

    def lay_out(self, model: BlockSequence, mesh: DeviceMesh, precision: str) -> list[nn.Module]:
        """Tensor parallelism if asked, then activation checkpointing if asked, then FSDP2 per block over the
        data-parallel dimension, gathering parameters in the precision's compute dtype; not FSDP over one
        data-parallel rank (``shards``)."""
        self.tensor_parallel.apply(model, mesh)
        if self.expert_parallel > 1:
            apply_expert_parallel(model, mesh[EXPERT])
        param_dtype = fsdp_param_dtype(precision)
        apply_activation_checkpointing(model, self.activation_checkpointing)
        if not self.shards(mesh[DATA_PARALLEL].size()):
            return [model]
        apply_fsdp(
            model,
            mesh[DATA_PARALLEL],
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=param_dtype,
            reduce_dtype=self.reduce_dtype if param_dtype is not None else None,
            cpu_offload=self.cpu_offload,
            expert_shard_mesh=mesh[EXPERT_SHARD] if self.expert_parallel > 1 else None,
        )
        return [model]

    def shards(self, data_parallel: int) -> bool:
        """Whether FSDP wraps the model over ``data_parallel`` ranks. Over one it shards nothing, yet its hooks,
        copies and DTensor optimizer cost every step (``benchmarks/host_costs.py``: each module's hooks some 60
        eager ops' worth of host time a step): the model trains unwrapped there, as plain training does, unless
        its parameters are offloaded to the CPU."""
        return data_parallel > 1 or self.cpu_offload

    def wraps_one_rank(self, job: Job) -> bool:
        return self.cpu_offload and job.dims.data_parallel == 1

    def bubble_fraction(self) -> float:
        return 0.0

    def with_activation_checkpointing(self, mode: Checkpointing) -> "FSDPLayout":
        return replace(self, activation_checkpointing=mode)

    def setting_values(self) -> dict[Setting, Any]:
        return {**super().setting_values(), Setting.EXPERT_PARALLEL_SIZE: self.expert_parallel}

    def memory_saving_changes(self, job: Job) -> Iterator[Change]:
        return iter(())  # the planner's own changes (checkpointing, a smaller batch, more devices) are FSDP's

    def search_space(self, job: Job, global_batch: int) -> Iterator[Change]:
        """FSDP alone, and over groups of each tensor-parallel size within a node; for a mixture of experts, each
        with its experts split over groups of each size within a node that divides them (expert parallelism)."""
        experts = expert_counts(job.meta_net())
        for size in divisors(job.devices):
            replicas = ParallelDims(job.world_size, tensor_parallel=size, shard=True).data_parallel
            if global_batch % replicas:
                continue
            for expert_size in expert_parallel_sizes(experts, replicas, job.devices):
                layout = replace(
                    self, tensor_parallel=replace(self.tensor_parallel, size=size), expert_parallel=expert_size
                )
                sets = {Setting.TENSOR_PARALLEL_SIZE} if size > 1 else set()
                sets |= {Setting.EXPERT_PARALLEL_SIZE} if expert_size > 1 else set()
                yield Change(replace(job, layout=layout, batch_size=global_batch // replicas), frozenset(sets))
