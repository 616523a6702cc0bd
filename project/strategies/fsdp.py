"""``strategy=fsdp``: FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy.

Lightning's ``FSDPStrategy`` wraps the legacy FSDP1 and refuses CPUs; ``ModelParallelStrategy`` hosts FSDP2, runs on
CPU (gloo) as on GPU (nccl), and saves distributed checkpoints (each rank writes its own shards, swapped in
atomically by ``ShardedCheckpointStrategy``). This subclass fixes its mesh to pure data parallelism over every
rank and shards the model per block (``project.parallel``).
"""

from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric.connector import _convert_precision_to_unified_args
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from project.checks import uses_cuda
from project.errors import ConfigError
from project.memory_plan import DeviceWork, fake_process_group
from project.parallel import apply_activation_checkpointing, apply_fsdp, fsdp_param_dtype
from project.strategies.sharded import ShardedCheckpointStrategy


class FSDPStrategy(ShardedCheckpointStrategy):
    """Fully sharded data parallel: parameters, gradients and optimizer state split across all ranks."""

    def __init__(
        self,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        reduce_dtype: str = "float32",
        **kwargs: Any,
    ) -> None:
        super().__init__(tensor_parallel_size=1, **kwargs)
        self.reshard_after_forward = reshard_after_forward
        self.activation_checkpointing = activation_checkpointing
        self.cpu_offload = cpu_offload
        self.reduce_dtype = getattr(torch, reduce_dtype)

    @classmethod
    def check_config(cls, cfg: DictConfig, net: nn.Module) -> None:
        super().check_config(cfg, net)
        if cfg.strategy.cpu_offload and not uses_cuda(cfg):
            raise ConfigError(
                "strategy.cpu_offload",
                "moves parameter shards from GPU to CPU memory, but this run has no GPU.",
                "set strategy.cpu_offload=false, or run on GPUs (trainer.accelerator=gpu).",
            )

    def setup_environment(self) -> None:
        # Every rank is one data-parallel shard (ModelParallelStrategy's default would use one per node).
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def parallelize(self, model: nn.Module) -> None:
        """Called from the LightningModule's ``configure_model`` with its plain model."""
        shard(model, self.device_mesh["data_parallel"], self.precision_plugin.precision, self.activation_checkpointing,
              self.reshard_after_forward, self.reduce_dtype, self.cpu_offload)

    @classmethod
    def simulated_devices(cls, cfg: DictConfig, new_module: Callable[[], nn.Module]) -> Iterator[DeviceWork]:
        """For the memory plan: rank 0, whose shards are the largest (FSDP cuts dimension 0 into equal chunks,
        the last ones shorter), laid out over a fake process group of the job's size."""
        strategy, world = cfg.strategy, cfg.strategy.processes * cfg.trainer.num_nodes
        with fake_process_group(world, rank=0):
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
            module = new_module()
            shard(module.net, mesh, _convert_precision_to_unified_args(cfg.trainer.precision),
                  strategy.activation_checkpointing, strategy.reshard_after_forward, getattr(torch, strategy.reduce_dtype),
                  strategy.cpu_offload)
            yield DeviceWork("rank 0", module, [module.net], cfg.data.batch_size)


def shard(model: nn.Module, mesh: DeviceMesh, precision: str, activation_checkpointing: bool,
          reshard_after_forward: bool, reduce_dtype: torch.dtype, cpu_offload: bool) -> None:
    """The model as this strategy lays it out: activation checkpointing if asked, then FSDP2 per block, gathering
    parameters in the precision's compute dtype."""
    param_dtype = fsdp_param_dtype(precision)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, mesh, reshard_after_forward=reshard_after_forward, param_dtype=param_dtype,
               reduce_dtype=reduce_dtype if param_dtype is not None else None, cpu_offload=cpu_offload)
