"""Lightning strategies of this project, built on torch.distributed's own parallelism."""

from project.strategies.fsdp import FSDPStrategy
from project.strategies.model_parallel import ManualModelParallelStrategy
from project.strategies.pipeline import PipelineStrategy
from project.strategies.tensor_parallel import TensorParallelStrategy

__all__ = ["FSDPStrategy", "ManualModelParallelStrategy", "PipelineStrategy", "TensorParallelStrategy"]
