"""``strategy=tensor_parallel``: every layer split across all the devices of one replica; the layout is
``project.layouts.tensor_parallel_layout``'s."""

from typing import Any

from project.layouts.sharded_layout import TensorParallel
from project.layouts.tensor_parallel_layout import TensorParallelLayout
from project.options.option_types import PositiveInt
from project.strategies.sharded import ShardedStrategy


class TensorParallelStrategy(ShardedStrategy):
    """``tensor_parallel_size`` ranks split every layer, and they are all the job's ranks: one replica."""

    def __init__(
        self,
        tensor_parallel_size: PositiveInt = 1,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        **kwargs: Any,
    ) -> None:
        layout = TensorParallelLayout(
            tensor_parallel=TensorParallel(tensor_parallel_size, sequence_parallel, loss_parallel)
        )
        super().__init__(layout, **kwargs)
