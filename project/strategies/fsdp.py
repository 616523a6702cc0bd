"""``strategy=fsdp``: FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy, optionally with tensor
parallelism inside each data-parallel replica (2D) and a mixture's experts split over groups of data-parallel ranks
(expert parallelism); the layout is ``project.layouts.fsdp_layout``'s.

Lightning's ``FSDPStrategy`` wraps the legacy FSDP1 and refuses CPUs; ``ModelParallelStrategy`` hosts FSDP2, runs on
CPU (gloo) as on GPU (nccl), and saves distributed checkpoints (each rank writes its own shards, swapped in
atomically by ``ShardedStrategy``).
"""

from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from project.layouts.fsdp_layout import FSDPLayout
from project.layouts.sharded_layout import TensorParallel
from project.models.sequence import BlockSequence
from project.options.option_types import PositiveInt
from project.parallel.dims import DATA_PARALLEL
from project.parallel.parallelize import ActivationCheckpointing, checkpointing_mode
from project.strategies.sharded import ShardedStrategy


class FSDPStrategy(ShardedStrategy):
    """Fully sharded data parallel: parameters, gradients and optimizer state split across the data-parallel ranks
    (all of them, or the groups of ``tensor_parallel_size`` ranks that each split every layer)."""

    layout: FSDPLayout

    def __init__(
        self,
        reshard_after_forward: bool = True,
        activation_checkpointing: ActivationCheckpointing = False,
        cpu_offload: bool = False,
        reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        tensor_parallel_size: PositiveInt = 1,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        expert_parallel_size: PositiveInt = 1,
        **kwargs: Any,
    ) -> None:
        layout = FSDPLayout(
            tensor_parallel=TensorParallel(tensor_parallel_size, sequence_parallel, loss_parallel),
            reshard_after_forward=reshard_after_forward,
            activation_checkpointing=checkpointing_mode(activation_checkpointing),
            cpu_offload=cpu_offload,
            reduce_dtype=getattr(torch, reduce_dtype),
            expert_parallel=expert_parallel_size,
        )
        super().__init__(layout, **kwargs)

    def parallelize(self, model: BlockSequence) -> None:
        super().parallelize(model)
        if not self.layout.shards(self.device_mesh[DATA_PARALLEL].size()):
            rank_zero_info(
                "strategy=fsdp over one data-parallel rank: nothing to shard, so FSDP does not wrap the model (its "
                "hooks and copies would slow every step); it trains as plain training does, checkpoints as FSDP's."
            )
