"""Lightning strategies of this project, built on torch.distributed's own parallelism."""

from project.strategies.fsdp import FSDPStrategy
from project.strategies.model_parallel import ManualModelParallelStrategy
from project.strategies.pipeline import PipelineStrategy

__all__ = ["FSDPStrategy", "ManualModelParallelStrategy", "PipelineStrategy"]
