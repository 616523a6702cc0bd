"""Lightning strategies of this project, each applying its layout (``project.layouts``) at run time: FSDP, tensor
parallelism, a pipeline (with both inside), and manual model parallelism from one process."""

from project.strategies.fsdp import FSDPStrategy
from project.strategies.laid_out import LaidOutStrategy
from project.strategies.model_parallel import ManualModelParallelStrategy
from project.strategies.pipeline import PipelineStrategy
from project.strategies.tensor_parallel import TensorParallelStrategy

__all__ = [
    "FSDPStrategy",
    "LaidOutStrategy",
    "ManualModelParallelStrategy",
    "PipelineStrategy",
    "TensorParallelStrategy",
]
