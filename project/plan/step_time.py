"""How long a training step takes: predicted from what a memory plan's simulation counted on each device (its
FLOPs and every collective's bytes, ``project.accounting.counts``) and a cluster's datasheet figures (``conf/cluster``).

The model, per device of the plan:

- compute: FLOPs / (the GPU's dense peak x ``compute_efficiency``, calibrated once: docs/step-time.md);
- each collective: the bytes a rank puts on the wire (ring algorithms: an all-gather or reduce-scatter of S bytes
  over n ranks sends S(n-1)/n, an all-reduce twice that; a send its bytes) over the link its group crosses: the
  node's (NVLink) if all its ranks are on one node, else each GPU's network port;
- overlap: collectives over the data-parallel dimension run beside the compute (FSDP gathers the next block's
  parameters and reduces the last one's gradients while a block computes; DDP all-reduces its buckets during
  backward), so only what exceeds the compute shows; tensor parallelism's and a pipeline's sends wait for their
  results, so all of theirs shows;
- a pipeline's idle share (its bubble, ``Layout.bubble_fraction``) stretches the slowest stage.

The step is the slowest device's. What it leaves out: elementwise kernels, norms and the optimizer (not counted as
FLOPs: the efficiency absorbs them), collectives' latency (only bandwidth), and contention between overlapped
collectives and compute.
"""

from dataclasses import dataclass

from project.accounting.counts import Link
from project.job.cluster import Cluster
from project.job.job import Job
from project.parallel.dims import DATA_PARALLEL
from project.plan.memory_plan import MemoryPlan
from project.plan.simulate import DevicePlan

GB = 1e9  # network and NVLink figures are decimal gigabytes per second, as datasheets give them


def wire_bytes(link: Link, size: int) -> float:
    """Bytes each rank sends for a collective whose whole buffer is ``size`` bytes, by ring (NCCL's bus
    bandwidth factors)."""
    n = link.ranks
    if link.kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return size * (n - 1) / n
    if link.kind == "all_reduce":
        return 2 * size * (n - 1) / n
    return size  # a send, a broadcast


def collective_seconds(link: Link, size: int, cluster: Cluster) -> float:
    bandwidth = cluster.intra_node_gb_per_s if link.nodes == 1 else cluster.inter_node_gb_per_s
    return wire_bytes(link, size) / (bandwidth * GB)


@dataclass
class DeviceTime:
    """One device's step: its compute, its collectives that overlap the compute and those that do not, seconds."""

    compute: float
    overlapped: float
    critical: float

    @property
    def busy(self) -> float:
        return self.compute + self.critical + max(0.0, self.overlapped - self.compute)


def device_time(device: DevicePlan, cluster: Cluster) -> DeviceTime:
    compute = device.flops / (cluster.peak_tflops * 1e12 * cluster.compute_efficiency)
    overlapped = critical = 0.0
    for key, size in device.collectives.items():
        link = Link.parse(key)
        seconds = collective_seconds(link, size, cluster)
        if link.dim == DATA_PARALLEL and link.kind != "send":  # runs beside the compute
            overlapped += seconds
        else:
            critical += seconds
    return DeviceTime(compute, overlapped, critical)


@dataclass
class StepTime:
    """A layout's predicted step: seconds, what of it is compute, exposed communication and pipeline bubble; the
    tokens (samples, for a model without a sequence) each device trains per second; and the model FLOPs
    utilisation (the step's FLOPs without activation checkpointing's recompute, over the time at peak)."""

    seconds: float
    compute: float
    exposed_communication: float
    bubble: float
    tokens_per_device_per_s: float
    mfu: float


def throughput_unit(job: Job) -> str:
    return "tokens" if job.seq_length else "samples"


def throughput_bound(job: Job, cluster: Cluster, flops_per_device: float) -> float:
    """The most tokens/s per device ``predict_step`` can give a layout whose devices compute ``flops_per_device`` on
    average: its slowest device computes at least that, and its step is at least that compute, with nothing
    exposed, stretched by its bubble."""
    compute = flops_per_device / (cluster.peak_tflops * 1e12 * cluster.compute_efficiency)
    dims = job.dims
    return job.tokens_per_step * dims.data_parallel / dims.world_size * (1 - job.layout.bubble_fraction()) / compute


def predict_step(plan: MemoryPlan, job: Job, cluster: Cluster) -> StepTime:
    """The step of ``job``'s layout, as ``plan`` counts it, on ``cluster``; its MFU counts the slowest device's
    FLOPs but activation checkpointing's recompute."""
    times = [device_time(device, cluster) for device in plan.devices]
    slowest = max(range(len(times)), key=lambda index: times[index].busy)
    busy = times[slowest]
    seconds = busy.busy / (1 - job.layout.bubble_fraction())
    tokens = job.tokens_per_step * job.dims.data_parallel / plan.world_size
    flops = plan.devices[slowest].flops - plan.devices[slowest].recomputed_flops
    return StepTime(
        seconds,
        busy.compute,
        busy.busy - busy.compute,
        seconds - busy.busy,
        tokens / seconds,
        flops / seconds / (cluster.peak_tflops * 1e12),
    )


def format_step(step: StepTime, cluster: Cluster, job: Job) -> str:
    return (
        f"Predicted on {cluster.name}: {step.seconds:.3g} s a step ({step.compute:.3g} s compute, "
        f"{step.exposed_communication:.2g} s exposed communication, {step.bubble:.2g} s pipeline bubble), "
        f"{step.tokens_per_device_per_s:,.0f} {throughput_unit(job)}/s per GPU, MFU {100 * step.mfu:.1f}% "
        "(docs/step-time.md)."
    )
