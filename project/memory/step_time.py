"""How long a training step takes: predicted from what a memory plan's simulation counted on each device (its
FLOPs and every collective's bytes, ``project.memory.counts``) and a cluster's datasheet figures (``conf/cluster``).

The model, per device of the plan:

- compute: FLOPs / (the GPU's dense peak x ``compute_efficiency``, calibrated once: docs/step-time.md);
- each collective: the bytes a rank puts on the wire (ring algorithms: an all-gather or reduce-scatter of S bytes
  over n ranks sends S(n-1)/n, an all-reduce twice that; a send its bytes) over the link its group crosses: the
  node's (NVLink) if all its ranks are on one node, else each GPU's network port;
- overlap: collectives over the data-parallel dimension run beside the compute (FSDP gathers the next block's
  parameters and reduces the last one's gradients while a block computes; DDP all-reduces its buckets during
  backward), so only what exceeds the compute shows; tensor parallelism's and a pipeline's sends wait for their
  results, so all of theirs shows;
- a pipeline's idle share (its bubble, ``bubble_fraction`` on the strategy class) stretches the slowest stage.

The step is the slowest device's. What it leaves out: elementwise kernels, norms and the optimizer (not counted as
FLOPs: the efficiency absorbs them), collectives' latency (only bandwidth), and contention between overlapped
collectives and compute.
"""

from dataclasses import dataclass, fields

from omegaconf import DictConfig

from project.config.checks import strategy_class
from project.distributed.dims import DATA_PARALLEL, ParallelDims
from project.memory.counts import Link
from project.memory.plan import DevicePlan, MemoryPlan

GB = 1e9  # network and NVLink figures are decimal gigabytes per second, as datasheets give them


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

    @classmethod
    def of(cls, cfg: DictConfig) -> "Cluster":
        return cls(**{field.name: cfg.cluster[field.name] for field in fields(cls)})


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


def tokens_per_step(cfg: DictConfig) -> int:
    """Tokens (or samples) one data-parallel replica trains in a step: ``data.batch_size`` sequences."""
    return int(cfg.data.batch_size * (cfg.data.get("seq_length") or 1))


def throughput_unit(cfg: DictConfig) -> str:
    return "tokens" if cfg.data.get("seq_length") else "samples"


def bubble_fraction(cfg: DictConfig) -> float:
    """The share of a step the layout's devices wait idle: a pipeline's bubble (``bubble_fraction`` on the strategy
    class), else none."""
    return getattr(strategy_class(cfg), "bubble_fraction", lambda cfg: 0.0)(cfg)


def throughput_bound(cfg: DictConfig, dims: ParallelDims, cluster: Cluster, flops_per_device: float) -> float:
    """The most tokens/s per device ``predict_step`` can give a layout whose devices compute ``flops_per_device`` on
    average: its slowest device computes at least that, and its step is at least that compute, with nothing
    exposed, stretched by its bubble."""
    compute = flops_per_device / (cluster.peak_tflops * 1e12 * cluster.compute_efficiency)
    return tokens_per_step(cfg) * dims.data_parallel / dims.world_size * (1 - bubble_fraction(cfg)) / compute


def predict_step(plan: MemoryPlan, cfg: DictConfig, dims: ParallelDims, cluster: Cluster) -> StepTime:
    """The step of ``plan``'s layout (its ranks divided as ``dims``) on ``cluster``; its MFU counts the slowest
    device's FLOPs but activation checkpointing's recompute."""
    times = [device_time(device, cluster) for device in plan.devices]
    slowest = max(range(len(times)), key=lambda index: times[index].busy)
    busy = times[slowest]
    seconds = busy.busy / (1 - bubble_fraction(cfg))
    tokens = tokens_per_step(cfg) * dims.data_parallel / plan.world_size
    flops = plan.devices[slowest].flops - plan.devices[slowest].recomputed_flops
    return StepTime(
        seconds,
        busy.compute,
        busy.busy - busy.compute,
        seconds - busy.busy,
        tokens / seconds,
        flops / seconds / (cluster.peak_tflops * 1e12),
    )


def format_step(step: StepTime, cluster: Cluster, cfg: DictConfig) -> str:
    return (
        f"Predicted on {cluster.name}: {step.seconds:.3g} s a step ({step.compute:.3g} s compute, "
        f"{step.exposed_communication:.2g} s exposed communication, {step.bubble:.2g} s pipeline bubble), "
        f"{step.tokens_per_device_per_s:,.0f} {throughput_unit(cfg)}/s per GPU, MFU {100 * step.mfu:.1f}% "
        "(docs/step-time.md)."
    )
