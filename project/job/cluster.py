"""The GPU nodes a job is planned for (``conf/cluster``): what the memory plan sizes a device by and the step-time
model predicts on."""

from dataclasses import dataclass
from typing import Annotated

from project.options.option_types import PositiveFloat, PositiveInt, Range


@dataclass(frozen=True)
class Cluster:
    """One kind of GPU node (``conf/cluster``): each GPU's dense peak in TFLOPS and memory in GB, the GPUs a node
    joins with NVLink, the bandwidth each GPU has each way inside a node and to other nodes (GB/s), and the share of
    the peak a training step's matmuls reach. The hints are the ranges ``cluster.*`` is checked against before
    launch (``project.config.schema``)."""

    name: str
    peak_tflops: PositiveFloat
    memory_gb: PositiveFloat
    devices_per_node: PositiveInt
    intra_node_gb_per_s: PositiveFloat
    inter_node_gb_per_s: PositiveFloat
    compute_efficiency: Annotated[float, Range(low=0, high=1, low_open=True)]
