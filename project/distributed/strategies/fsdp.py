"""``strategy=fsdp``: FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy, optionally with tensor
parallelism inside each data-parallel replica (2D).

Lightning's ``FSDPStrategy`` wraps the legacy FSDP1 and refuses CPUs; ``ModelParallelStrategy`` hosts FSDP2, runs on
CPU (gloo) as on GPU (nccl), and saves distributed checkpoints (each rank writes its own shards, swapped in
atomically by ``ShardedCheckpointStrategy``). The mesh is (data_parallel x tensor_parallel): with the default
``tensor_parallel_size=1`` every rank is a data-parallel shard; with T, each group of T ranks splits every layer
(``TensorParallel``) and FSDP shards those splits over the groups, torchtitan's order: tensor parallelism,
activation checkpointing (``strategy.activation_checkpointing``), then FSDP per block
(``project.distributed.parallelize``). The
model's own activation checkpointing and compilation (``model.*``) wrap the blocks before the strategy acts.
"""

from collections.abc import Iterator
from typing import Any, Literal

import torch
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh

from project.config.checks import uses_cuda
from project.config.errors import ConfigError
from project.distributed.dims import DATA_PARALLEL, ParallelDims, divisors
from project.distributed.parallelize import apply_activation_checkpointing, apply_fsdp, fsdp_param_dtype
from project.distributed.strategies.sharded import ShardedStrategy
from project.models.sequence import BlockSequence


class FSDPStrategy(ShardedStrategy):
    """Fully sharded data parallel: parameters, gradients and optimizer state split across the data-parallel ranks
    (all of them, or the groups of ``tensor_parallel_size`` ranks that each split every layer)."""

    def __init__(
        self,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.reshard_after_forward = reshard_after_forward
        self.activation_checkpointing = activation_checkpointing
        self.cpu_offload = cpu_offload
        self.reduce_dtype = getattr(torch, reduce_dtype)

    def dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(world_size, tensor_parallel=self.tensor_parallel.size, shard=True)

    @classmethod
    def search_layouts(cls, cfg: DictConfig, global_batch: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """For plan=search: FSDP alone, and over groups of each tensor-parallel size within a node, each replica
        taking its share of ``global_batch``; as overrides (text, and keys to values). The run's checks drop those
        the model cannot split."""
        world = cfg.strategy.processes * cfg.trainer.num_nodes
        for size in divisors(cfg.trainer.devices):
            replicas = ParallelDims(world, tensor_parallel=size, shard=True).data_parallel
            if global_batch % replicas == 0:
                text = f"strategy.tensor_parallel_size={size}" if size > 1 else ""
                yield text, {"strategy.tensor_parallel_size": size, "data.batch_size": global_batch // replicas}

    @classmethod
    def check_config(cls, cfg: DictConfig, net: BlockSequence, ckpt_path: str | None) -> None:
        super().check_config(cfg, net, ckpt_path)
        if cfg.strategy.cpu_offload and not uses_cuda(cfg):
            raise ConfigError(
                "strategy.cpu_offload",
                "moves parameter shards from GPU to CPU memory, but this run has no GPU.",
                "set strategy.cpu_offload=false, or run on GPUs (trainer.accelerator=gpu).",
            )

    def lay_out(self, model: BlockSequence, mesh: DeviceMesh, precision: str) -> None:
        """Tensor parallelism if asked, then activation checkpointing if asked, then FSDP2 per block over the
        data-parallel dimension, gathering parameters in the precision's compute dtype."""
        self.tensor_parallel.apply(model, mesh)
        param_dtype = fsdp_param_dtype(precision)
        if self.activation_checkpointing:
            apply_activation_checkpointing(model)
        apply_fsdp(
            model,
            mesh[DATA_PARALLEL],
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=param_dtype,
            reduce_dtype=self.reduce_dtype if param_dtype is not None else None,
            cpu_offload=self.cpu_offload,
        )
