"""Each strategy's layout of a job's devices (``project.job.job.Layout``), one file each: the function that applies
it to a plain model (``lay_out``) beside what the checks and the planner read of it (its mesh dims, its rules, the
devices it simulates, its bubble, its memory-saving changes, its search space). The Lightning strategies
(``project.strategies``) apply them at run time."""

from project.layouts.data_parallel_layout import DataParallelLayout
from project.layouts.fsdp_layout import FSDPLayout
from project.layouts.model_parallel_layout import ModelParallelLayout
from project.layouts.pipeline_layout import PipelineLayout
from project.layouts.sharded_layout import ShardedLayout, TensorParallel
from project.layouts.tensor_parallel_layout import TensorParallelLayout

__all__ = [
    "DataParallelLayout",
    "FSDPLayout",
    "ModelParallelLayout",
    "PipelineLayout",
    "ShardedLayout",
    "TensorParallel",
    "TensorParallelLayout",
]
