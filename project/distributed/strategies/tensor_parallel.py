"""``strategy=tensor_parallel``: every layer split across all the devices of one replica (Megatron's tensor
parallelism, on DTensor), with the rules and options that fsdp and pipeline share when they split layers too.

Each model's plan is a plain function next to it (``project.distributed.plans``): attention heads and MLP
units split across the ranks, norms on each rank's share of the sequence, token embedding and output layer split
by vocabulary. The ranks of a tensor-parallel group compute the same batch together, so they count as one
data-parallel replica. ``FSDPStrategy`` builds on this class: a (data_parallel x tensor_parallel) mesh, FSDP over
the first dimension (2D); ``PipelineStrategy`` splits each stage the same way (3D).
"""

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
from lightning.fabric.connector import _convert_precision_to_unified_args
from omegaconf import DictConfig
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from project.config.checks import build_strategy, positive_int_at
from project.config.errors import ConfigError
from project.memory.plan import DeviceWork, fake_process_group
from project.models import GPT, Llama
from project.distributed.plans import PLANS, apply_tensor_parallel, split_sizes
from project.distributed.strategies.sharded import ShardedCheckpointStrategy

SEQUENCE_MODELS = (GPT, Llama)  # whose activations have a sequence dimension to split (sequence parallelism)


def check_tensor_parallel(cfg: DictConfig, net: nn.Module) -> int:
    """Rules of ``strategy.tensor_parallel_size`` for this model (``net`` on the meta device); returns the size."""
    size = positive_int_at(cfg, "strategy.tensor_parallel_size",
                           "set strategy.tensor_parallel_size to the ranks that split each layer (1: none).")
    if size == 1:
        return size
    if type(net) not in PLANS:
        raise ConfigError("strategy.tensor_parallel_size", f"is {size}, but {type(net).__name__} has no "
                          "tensor-parallel plan (project/distributed/plans.py).",
                          "set strategy.tensor_parallel_size=1.")
    for argument, what, value in split_sizes(net):
        if value % size:
            raise ConfigError(f"model.net.{argument}", f"gives the model's {what} ({value}), which {size} "
                              "tensor-parallel ranks (strategy.tensor_parallel_size) cannot share evenly.",
                              f"use a multiple of {size}, or a strategy.tensor_parallel_size that divides {value}.")
    if isinstance(net, SEQUENCE_MODELS) and cfg.strategy.sequence_parallel and cfg.data.seq_length % size:
        raise ConfigError("data.seq_length", f"is {cfg.data.seq_length}, which {size} tensor-parallel ranks cannot "
                          "share evenly under sequence parallelism (strategy.sequence_parallel).",
                          f"use a multiple of {size}, or strategy.sequence_parallel=false.")
    return size


class TensorParallelStrategy(ShardedCheckpointStrategy):
    """``tensor_parallel_size`` ranks split every layer; the job's ranks beyond one group would be data parallel,
    which this class leaves to ``FSDPStrategy`` (``shards_data_parallel``).

    ``sequence_parallel``: norms and the residual stream hold each rank's share of the sequence. ``loss_parallel``:
    a language model's logits stay split by vocabulary into the loss (``TokenCrossEntropy`` computes it under
    torch's ``loss_parallel``, and so does the backward here) instead of being gathered on every rank.
    """

    shards_data_parallel = False

    def __init__(self, tensor_parallel_size: int = 1, sequence_parallel: bool = True, loss_parallel: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel

    @property
    def tensor_parallel_size(self) -> int:
        return self._tensor_parallel_size

    @classmethod
    def check_config(cls, cfg: DictConfig, net: nn.Module) -> None:
        super().check_config(cfg, net)
        size, per_node = check_tensor_parallel(cfg, net), cfg.strategy.processes
        ranks = per_node * cfg.trainer.num_nodes
        if ranks % size:
            raise ConfigError("trainer.devices", f"gives {ranks} processes, not a multiple of "
                              f"strategy.tensor_parallel_size={size}.",
                              f"use a multiple of {size} devices, or a tensor_parallel_size that divides {ranks}.")
        if per_node % size and size % per_node:  # a group's ranks are consecutive: whole nodes, or within one
            raise ConfigError("strategy.tensor_parallel_size", f"is {size}: groups of {size} consecutive ranks would "
                              f"straddle nodes of {per_node} devices (trainer.devices).",
                              f"use a divisor of {per_node} (within a node, where the links are fastest) or a "
                              f"multiple of it.")
        if ranks > size and not cls.shards_data_parallel:
            raise ConfigError("strategy.tensor_parallel_size", f"is {size} of the job's {ranks} processes; "
                              "strategy=tensor_parallel runs one replica, which spans them all.",
                              f"use strategy=fsdp strategy.tensor_parallel_size={size} to shard the {ranks // size} "
                              f"replicas with FSDP, or strategy.tensor_parallel_size={ranks} to split every layer "
                              "over all of them.")

    @classmethod
    def data_parallel_replicas(cls, cfg: DictConfig) -> int:
        """The ranks of a tensor-parallel group compute one replica's batch together."""
        return cfg.strategy.processes * cfg.trainer.num_nodes // cfg.strategy.tensor_parallel_size

    @classmethod
    def runs_whole_model(cls, cfg: DictConfig) -> bool:
        """Whether each rank can run the model's forward on its own input (callbacks that need it ask)."""
        return cfg.strategy.tensor_parallel_size == 1

    def setup_environment(self) -> None:
        # The (data_parallel, tensor_parallel) mesh of Lightning's ModelParallelStrategy, every rank in it (its
        # default would make one data-parallel replica per node).
        self._data_parallel_size = self.num_nodes * self.num_processes // self._tensor_parallel_size
        super().setup_environment()

    @property
    def vocab_parallel(self) -> bool:
        """Whether a language model's logits stay split by vocabulary into the loss."""
        return self.loss_parallel and self.tensor_parallel_size > 1

    def parallelize(self, model: nn.Module) -> None:
        """Called from the LightningModule's ``configure_model`` with its plain (meta) model."""
        self.lay_out(model, self.device_mesh, self.precision_plugin.precision)

    def lay_out(self, model: nn.Module, mesh: DeviceMesh, precision: str) -> None:
        """``model`` (on the meta device) as this strategy lays it out over ``mesh``: each layer split over the
        tensor-parallel dimension. Real runs and the memory plan's simulated devices both come here."""
        if self.tensor_parallel_size > 1:
            apply_tensor_parallel(model, mesh["tensor_parallel"], self.sequence_parallel, self.vocab_parallel)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The loss of vocabulary-split logits has its own backward, which torch runs only inside loss_parallel.
        with loss_parallel() if self.vocab_parallel else nullcontext():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @classmethod
    def simulated_devices(cls, cfg: DictConfig, new_module: Callable[[], nn.Module]) -> Iterator[DeviceWork]:
        """For the memory plan: rank 0, whose shards are the largest (FSDP and an uneven vocabulary leave the last
        ranks' shorter), laid out as in a real run over a fake process group of the job's size."""
        strategy, world = build_strategy(cfg.strategy), cfg.strategy.processes * cfg.trainer.num_nodes
        with fake_process_group(world, rank=0):
            size = strategy.tensor_parallel_size
            mesh = init_device_mesh("cpu", (world // size, size), mesh_dim_names=("data_parallel", "tensor_parallel"))
            module = new_module()
            strategy.lay_out(module.net, mesh, _convert_precision_to_unified_args(cfg.trainer.precision))
            yield DeviceWork("rank 0", module, [module.net], cfg.data.batch_size, loss_parallel=strategy.vocab_parallel)
