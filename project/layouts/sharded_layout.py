"""What the layouts whose ranks each hold a part of the model share (fsdp, tensor_parallel, pipeline): Lightning's
ModelParallelStrategy underneath (its precisions, its sharded checkpoints), and tensor parallelism as a part they
are composed of (``TensorParallel``: every layer split over the ``size`` neighbouring ranks of a replica,
Megatron's tensor parallelism on DTensor, with each model's plan from ``project.parallel.tensor_parallel_plans``).
"""

from abc import abstractmethod
from collections.abc import Generator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from project.job.job import Job, Setting
from project.job.layout import DeviceWork, Layout
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.parallel.dims import TENSOR_PARALLEL
from project.parallel.expert_parallel import expert_counts
from project.parallel.fake_process_group import fake_process_group
from project.parallel.tensor_parallel_plans import apply_tensor_parallel, model_plan

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

    def problem(self, job: Job, net: BlockSequence) -> ConfigError | None:
        """What is wrong with ``strategy.tensor_parallel_size`` for this model (``net`` on the meta device) and the
        job's ranks, or None."""
        size, per_node = self.size, job.processes_per_node
        if size > 1:
            plan = model_plan(net)
            if plan is None:
                return ConfigError(
                    "strategy.tensor_parallel_size",
                    f"is {size}, but {type(net).__name__} has no tensor-parallel plan "
                    "(project/parallel/tensor_parallel_plans.py).",
                    "set strategy.tensor_parallel_size=1.",
                )
            for argument, what, value in plan.split_sizes(net):
                if value % size:
                    return ConfigError(
                        f"model.net.{argument}",
                        f"gives the model's {what} ({value}), which {size} "
                        "tensor-parallel ranks (strategy.tensor_parallel_size) cannot share evenly.",
                        f"use a multiple of {size}, or a strategy.tensor_parallel_size that divides {value}.",
                    )
            if plan.has_sequence and self.sequence_parallel and (job.seq_length or 0) % size:
                return ConfigError(
                    "data.seq_length",
                    f"is {job.seq_length}, which {size} tensor-parallel ranks "
                    "cannot share evenly under sequence parallelism (strategy.sequence_parallel).",
                    f"use a multiple of {size}, or strategy.sequence_parallel=false.",
                )
        if job.world_size % size:
            return ConfigError(
                "trainer.devices",
                f"gives {job.world_size} processes, not a multiple of strategy.tensor_parallel_size={size}.",
                f"use a multiple of {size} devices, or a tensor_parallel_size that divides {job.world_size}.",
            )
        if per_node % size and size % per_node:  # a group's ranks are consecutive: whole nodes, or within one
            return ConfigError(
                "strategy.tensor_parallel_size",
                f"is {size}: groups of {size} consecutive ranks would "
                f"straddle nodes of {per_node} devices (trainer.devices).",
                f"use a divisor of {per_node} (within a node, where the links are fastest) or a multiple of it.",
            )
        return None


@dataclass(frozen=True, kw_only=True)
class ShardedLayout(Layout):
    """A layout of one process per device, each laying out its own part of the plain (meta) model over the job's
    device mesh (``lay_out``), with tensor parallelism (``tensor_parallel``) inside."""

    tensor_parallel: TensorParallel = field(default_factory=TensorParallel)

    def processes_per_node(self, devices: int) -> int:
        return devices

    @property
    def saves_sharded_checkpoints(self) -> bool:
        return True  # ModelParallelStrategy's distributed checkpoints, a dir of every rank's shards

    @abstractmethod
    def lay_out(self, model: BlockSequence, mesh: DeviceMesh, precision: str) -> Sequence[nn.Module]:
        """This rank's part of ``model`` (on the meta device) as the layout lays it out over ``mesh``: the modules
        the rank runs, in order. Real runs (``ShardedStrategy.parallelize``) and the memory plan's simulated devices
        both come here."""

    def problem(self, job: Job, net: BlockSequence) -> ConfigError | None:
        if job.precision not in SUPPORTED_PRECISIONS:
            return ConfigError(
                "trainer.precision",
                f"is {job.precision!r}, which Lightning's ModelParallelStrategy (under strategy=fsdp, pipeline and "
                "tensor_parallel) does not support.",
                f"use one of {', '.join(SUPPORTED_PRECISIONS)} (bf16-mixed: parameters are gathered and computed in "
                "bf16, gradients reduced in fp32).",
            )
        return self.tensor_parallel.problem(job, net)

    def simulated_devices(self, job: Job) -> Generator[DeviceWork, None, None]:
        """Rank 0, whose shards are the largest (FSDP and an uneven vocabulary leave the last ranks' shorter), laid
        out as in a real run over a fake process group of the job's size."""
        with fake_process_group(job.world_size, rank=0):
            mesh = self.dims(job.world_size).build_mesh("cpu")
            module = job.new_module()
            stages = self.lay_out(module.net, mesh, job.precision)
            yield DeviceWork(
                "rank 0", module, list(stages), job.batch_size, loss_parallel=self.tensor_parallel.vocab_parallel
            )

    def blocks_per_device(self, net: BlockSequence) -> list[int]:
        return [len(net.blocks)]

    def setting_values(self) -> dict[Setting, Any]:
        return {Setting.TENSOR_PARALLEL_SIZE: self.tensor_parallel.size}


def expert_parallel_problem(job: Job, net: BlockSequence, size: int, other_ranks: int) -> ConfigError | None:
    """Why ``net`` cannot split its experts over groups of ``size`` data-parallel ranks (None: it can), the job's
    ranks beyond the data-parallel ones being ``other_ranks`` for each (tensor-parallel, pipeline)."""
    if size == 1:
        return None
    experts = expert_counts(net)
    if not experts:
        return ConfigError(
            "strategy.expert_parallel_size",
            f"is {size}, but {type(net).__name__} has no mixture of experts to split.",
            "set strategy.expert_parallel_size=1, or train a mixture (model=moe).",
        )
    if experts[0] % size:
        return ConfigError(
            "strategy.expert_parallel_size",
            f"is {size}, which does not divide the {experts[0]} experts (model.net.num_experts).",
            f"use a divisor of {experts[0]}.",
        )
    if job.activation_checkpointing == "selective":
        # The experts' own FSDP unit gathers inside the checkpointed block: its hooks' ops, which the selective
        # policy's replay counts, differ between the forward and the recompute, and torch refuses the recompute.
        return ConfigError(
            "model.activation_checkpointing",
            f"is selective, which experts split over ranks (strategy.expert_parallel_size={size}) cannot use yet.",
            "use model.activation_checkpointing=true (every block recomputed) or false.",
        )
    replicas = job.world_size // other_ranks  # (checked to divide it before)
    if replicas % size:
        return ConfigError(
            "strategy.expert_parallel_size",
            f"is {size}, but the {replicas} data-parallel ranks do not divide into groups of {size}.",
            f"use a divisor of {replicas}, or a multiple of {size * other_ranks} devices (trainer.devices).",
        )
    return None
