"""Parallelism as plain functions on a model's ordered block sequence (``model.blocks``), torchtitan style.

Strategies call these; the models know nothing about them.
"""

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them.

    The composable ``checkpoint`` hooks the block in place, so parameter names, and with them checkpoints, stay
    the same as without it.
    """
    for block in model.blocks:
        checkpoint(block)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
) -> None:
    """Shard ``model`` with FSDP2 over ``mesh``: each block is one unit (gathered just before its own compute),
    then the root takes whatever parameters remain (embeddings, heads)."""
    if isinstance(model, FSDPModule):
        return  # already sharded (Lightning may configure the model again, e.g. for validate after fit)
    options = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy() if cpu_offload else None,
    )
    options = {key: value for key, value in options.items() if value is not None}
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
