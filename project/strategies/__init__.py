"""Lightning strategies of this project, built on torch.distributed's own parallelism."""

from project.strategies.fsdp import FSDPStrategy

__all__ = ["FSDPStrategy"]
