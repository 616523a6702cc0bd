"""The GPU nodes a job is planned for (``conf/cluster``): what the memory plan sizes a device by and the step-time
model predicts on."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Cluster:
    """One kind of GPU node (``conf/cluster``): each GPU's dense peak in TFLOPS and memory in GB, the GPUs a node
    joins with NVLink, the bandwidth each GPU has each way inside a node and to other nodes (GB/s), and the share of
    the peak a training step's matmuls reach."""

    name: str
    peak_tflops: float
    memory_gb: float
    devices_per_node: int
    intra_node_gb_per_s: float
    inter_node_gb_per_s: float
    compute_efficiency: float
