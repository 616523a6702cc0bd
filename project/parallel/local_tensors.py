"""This rank's part of a tensor, whether or not it is sharded: one definition for the code that reads or writes a
rank's own values (GRPO's kept weights, the experts' local weights, the memory trackers' byte counts)."""

import torch
from torch.distributed.tensor import DTensor


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values on this rank: a DTensor's local shard (FSDP's, tensor parallelism's), where its
    collectives read and write them; any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
