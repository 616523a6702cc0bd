"""``strategy=tensor_parallel``: every layer split across all the devices of one replica (Megatron's tensor
parallelism, on DTensor: ``TensorParallel`` in ``sharded.py``).

Each model's plan sits in one table (``project.distributed.plans``): attention heads and MLP units split across the
ranks, norms on each rank's share of the sequence, token embedding and output layer split by vocabulary. The ranks
of a tensor-parallel group compute the same batch together, so they count as one data-parallel replica; more
replicas are ``strategy=fsdp`` with the same ``tensor_parallel_size`` (2D), and a pipeline splits each stage the
same way (3D).
"""

from typing import Any

from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh

from project.config.errors import ConfigError
from project.distributed.dims import ParallelDims
from project.distributed.strategies.sharded import ShardedStrategy
from project.models.sequence import BlockSequence


class TensorParallelStrategy(ShardedStrategy):
    """``tensor_parallel_size`` ranks split every layer, and they are all the job's ranks: one replica."""

    def dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(world_size, tensor_parallel=self.tensor_parallel.size)

    @classmethod
    def check_config(cls, cfg: DictConfig, net: BlockSequence, ckpt_path: str | None) -> None:
        super().check_config(cfg, net, ckpt_path)
        size, ranks = cfg.strategy.tensor_parallel_size, cfg.strategy.processes * cfg.trainer.num_nodes
        if ranks > size:
            raise ConfigError(
                "strategy.tensor_parallel_size",
                f"is {size} of the job's {ranks} processes; "
                "strategy=tensor_parallel runs one replica, which spans them all.",
                f"use strategy=fsdp strategy.tensor_parallel_size={size} to shard the {ranks // size} "
                f"replicas with FSDP, or strategy.tensor_parallel_size={ranks} to split every layer "
                "over all of them.",
            )

    def lay_out(self, model: BlockSequence, mesh: DeviceMesh, precision: str) -> Any:
        """Each layer split over the tensor-parallel dimension."""
        self.tensor_parallel.apply(model, mesh)
