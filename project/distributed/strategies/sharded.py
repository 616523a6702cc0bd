"""What the strategies whose ranks each hold a part of the model share (fsdp, pipeline, tensor_parallel), as parts
they are composed of rather than classes they inherit from each other:

- ``ShardedStrategy``: Lightning's ModelParallelStrategy on the mesh of the strategy's ``ParallelDims``, with
  checkpoint saves that a killed run cannot leave half-written;
- ``TensorParallel``: every layer split over the ``tensor_parallel_size`` neighbouring ranks of a replica (Megatron's
  tensor parallelism on DTensor, with each model's plan from ``project.distributed.plans``), its rules and its loss.
"""

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from project.config.build import build_strategy
from project.config.errors import ConfigError
from project.config.option_types import PositiveInt
from project.distributed.dims import TENSOR_PARALLEL, ParallelDims
from project.distributed.plans import apply_tensor_parallel, model_plan
from project.memory.simulation import DeviceWork, TaskModule, fake_process_group
from project.models.sequence import BlockSequence

# What Lightning's ModelParallelStrategy accepts (it refuses 16-mixed, whose gradient scaler it does not drive).
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


@dataclass(frozen=True)
class TensorParallel:
    """``size`` ranks split every layer. ``sequence_parallel``: norms and the residual stream hold each rank's share
    of the sequence. ``loss_parallel``: a language model's logits stay split by vocabulary into the loss
    (``TokenCrossEntropy`` computes it under torch's ``loss_parallel``, and so does ``ShardedStrategy.backward``)
    instead of being gathered on every rank."""

    size: int = 1
    sequence_parallel: bool = True
    loss_parallel: bool = True

    @property
    def vocab_parallel(self) -> bool:
        """Whether a language model's logits stay split by vocabulary into the loss."""
        return self.loss_parallel and self.size > 1

    def apply(self, model: BlockSequence, mesh: DeviceMesh) -> None:
        """Split each layer of ``model`` (on the meta device) over the mesh's tensor-parallel dimension."""
        if self.size > 1:
            apply_tensor_parallel(model, mesh[TENSOR_PARALLEL], self.sequence_parallel, self.vocab_parallel)

    def loss_context(self) -> AbstractContextManager:
        """Where the loss of vocabulary-split logits is computed and differentiated: torch's ``loss_parallel``."""
        return loss_parallel() if self.vocab_parallel else nullcontext()

    @staticmethod
    def check_config(cfg: DictConfig, net: BlockSequence) -> int:
        """Rules of ``strategy.tensor_parallel_size`` for this model (``net`` on the meta device) and the job's
        ranks; returns the size."""
        size = cfg.strategy.tensor_parallel_size
        per_node = cfg.strategy.processes
        ranks = per_node * cfg.trainer.num_nodes
        if size > 1:
            plan = model_plan(net)
            if plan is None:
                raise ConfigError(
                    "strategy.tensor_parallel_size",
                    f"is {size}, but {type(net).__name__} has no tensor-parallel plan (project/distributed/plans.py).",
                    "set strategy.tensor_parallel_size=1.",
                )
            for argument, what, value in plan.split_sizes(net):
                if value % size:
                    raise ConfigError(
                        f"model.net.{argument}",
                        f"gives the model's {what} ({value}), which {size} "
                        "tensor-parallel ranks (strategy.tensor_parallel_size) cannot share evenly.",
                        f"use a multiple of {size}, or a strategy.tensor_parallel_size that divides {value}.",
                    )
            if plan.has_sequence and cfg.strategy.sequence_parallel and cfg.data.seq_length % size:
                raise ConfigError(
                    "data.seq_length",
                    f"is {cfg.data.seq_length}, which {size} tensor-parallel ranks "
                    "cannot share evenly under sequence parallelism (strategy.sequence_parallel).",
                    f"use a multiple of {size}, or strategy.sequence_parallel=false.",
                )
        if ranks % size:
            raise ConfigError(
                "trainer.devices",
                f"gives {ranks} processes, not a multiple of strategy.tensor_parallel_size={size}.",
                f"use a multiple of {size} devices, or a tensor_parallel_size that divides {ranks}.",
            )
        if per_node % size and size % per_node:  # a group's ranks are consecutive: whole nodes, or within one
            raise ConfigError(
                "strategy.tensor_parallel_size",
                f"is {size}: groups of {size} consecutive ranks would "
                f"straddle nodes of {per_node} devices (trainer.devices).",
                f"use a divisor of {per_node} (within a node, where the links are fastest) or a multiple of it.",
            )
        return size


class ShardedStrategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy on the device mesh of this strategy's ``dims``, each rank laying out its
    part of the plain (meta) model in ``lay_out``; tensor parallelism (``self.tensor_parallel``) inside."""

    def __init__(
        self,
        tensor_parallel_size: PositiveInt = 1,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(tensor_parallel_size=tensor_parallel_size, **kwargs)
        self.tensor_parallel = TensorParallel(tensor_parallel_size, sequence_parallel, loss_parallel)

    def dims(self, world_size: int) -> ParallelDims:
        """How the job's ``world_size`` ranks divide under this strategy."""
        raise NotImplementedError

    @classmethod
    def check_config(cls, cfg: DictConfig, net: BlockSequence, ckpt_path: str | None) -> None:
        """Rules checked before launch (``project.config.job``); each strategy adds its own."""
        precision = _convert_precision_to_unified_args(cfg.trainer.precision)
        if precision not in SUPPORTED_PRECISIONS:
            raise ConfigError(
                "trainer.precision",
                f"is {precision!r}, which Lightning's ModelParallelStrategy (under strategy=fsdp, pipeline and "
                "tensor_parallel) does not support.",
                f"use one of {', '.join(SUPPORTED_PRECISIONS)} (bf16-mixed: parameters are gathered and computed in "
                "bf16, gradients reduced in fp32).",
            )
        TensorParallel.check_config(cfg, net)

    def setup_environment(self) -> None:
        # ModelParallelStrategy's, on this strategy's mesh (Lightning's own is (data_parallel, tensor_parallel) with
        # one data-parallel replica per node).
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        self._device_mesh = self.dims(self.world_size).build_mesh(self.root_device.type)
        assert self.lightning_module is not None  # (as in Lightning's own setup_environment)
        self.lightning_module._device_mesh = self._device_mesh

    def parallelize(self, model: BlockSequence) -> None:
        """Called from the LightningModule's ``configure_model`` with its plain (meta) model."""
        self.lay_out(model, self.device_mesh, self.precision_plugin.precision)

    def lay_out(self, model: BlockSequence, mesh: DeviceMesh, precision: str) -> Any:
        """``model`` (on the meta device) as this strategy lays it out over ``mesh``. Real runs and the memory
        plan's simulated devices both come here."""
        raise NotImplementedError

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The loss of vocabulary-split logits has its own backward, which torch runs only inside loss_parallel.
        with self.tensor_parallel.loss_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @classmethod
    def simulated_devices(cls, cfg: DictConfig, new_module: Callable[[], TaskModule]) -> Iterator[DeviceWork]:
        """For the memory plan: rank 0, whose shards are the largest (FSDP and an uneven vocabulary leave the last
        ranks' shorter), laid out as in a real run over a fake process group of the job's size."""
        strategy, world = build_strategy(cfg.strategy), cfg.strategy.processes * cfg.trainer.num_nodes
        with fake_process_group(world, rank=0):
            mesh = strategy.dims(world).build_mesh("cpu")
            module = new_module()
            strategy.lay_out(module.net, mesh, _convert_precision_to_unified_args(cfg.trainer.precision))
            yield DeviceWork(
                "rank 0",
                module,
                [module.net],
                cfg.data.batch_size,
                loss_parallel=strategy.tensor_parallel.vocab_parallel,
            )

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        """Write into ``<name>.partial`` and swap it in only once every rank has finished.

        Lightning writes a sharded checkpoint in place, over the previous one of the same name (``last.ckpt``);
        a run killed meanwhile would leave ``last`` half old, half new. Here ``last`` is the old checkpoint until
        the new one is complete, then the new one.
        """
        final = Path(self.broadcast(str(filepath)))
        partial = final.with_name(final.name + ".partial")
        if self.global_rank == 0:
            _remove(partial)  # left over from a run killed while saving
        self.barrier()
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()
        if self.global_rank == 0:
            previous = final.with_name(final.name + ".previous")
            _remove(previous)
            if final.exists():
                os.replace(final, previous)
            os.replace(partial, final)
            _remove(previous)
        self.barrier()


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
