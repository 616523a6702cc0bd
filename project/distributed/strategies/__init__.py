"""Lightning strategies of this project, built on torch.distributed's own parallelism."""

from project.distributed.strategies.fsdp import FSDPStrategy
from project.distributed.strategies.model_parallel import ManualModelParallelStrategy
from project.distributed.strategies.pipeline import PipelineStrategy
from project.distributed.strategies.tensor_parallel import TensorParallelStrategy

__all__ = ["FSDPStrategy", "ManualModelParallelStrategy", "PipelineStrategy", "TensorParallelStrategy"]
