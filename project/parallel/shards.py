"""A tensor's values on this rank, whatever layout holds it."""

import torch
from torch.distributed.tensor import DTensor


def local_values(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values on this rank: a DTensor's local shard (FSDP's, tensor or expert parallelism's), where its
    collectives read them and an in-place write lands; any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
