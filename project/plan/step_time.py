"""How long a training step takes: predicted from what a memory plan's simulation counted on each device (every
matmul and attention kernel's shape, the bytes of every other op, every collective; ``project.accounting.counts``)
and a cluster's datasheet figures (``conf/cluster``): a roofline per op.

The model, per device of the plan:

- each matmul, attention or other kernel with a FLOP formula: the longer of its FLOPs over the GPU's throughput and
  its bytes over the GPU's memory bandwidth. The throughput is the dense BF16 peak at the clock the GPU's power
  limit allows (``clock_ratio``), times ``matmul_efficiency`` for matmuls (and times the share of the GPU's
  multiprocessors its last wave of 128 x 128 output tiles keeps busy: small matmuls and narrow shards run further
  from peak) or ``attention_efficiency`` for attention (a causal kernel computes half the products torch's formula
  counts);
- each Float8 matmul (``torch._scaled_mm``): as a matmul, at ``float8_matmul_efficiency`` of the FP8 peak;
- every other op (norms, activations, residual adds, softmax, casts, the optimizer): its bytes over the memory
  bandwidth; under ``model.compile`` a block's are what inductor's kernels for it read and write
  (``project.plan.compiled_blocks.FusedKernels``), a chain elsewhere in a compiled part reads only its inputs and
  writes only what something needs in memory (``StepCounts.fused``);
- the bandwidth is the datasheet's times ``bandwidth_efficiency``. The four efficiencies are the same for every
  GPU (``conf/step_time/roofline.yaml``): what differs between GPUs comes from their datasheets;
- each collective: NCCL's ring latency (``ring_latency``, NCCL's own tuning model) plus the bytes a rank puts on
  the wire (an all-gather or reduce-scatter of S bytes over n ranks sends S(n-1)/n, an all-reduce twice that; a
  send its bytes) over the link its group crosses: the node's (NVLink) if all its ranks are on one node, else
  each GPU's network port;
- overlap: collectives over the data-parallel dimension run beside the compute (FSDP gathers the next block's
  parameters and reduces the last one's gradients while a block computes; DDP all-reduces its buckets during
  backward), so only what exceeds the compute shows; tensor parallelism's collectives, expert parallelism's
  all-to-alls and a pipeline's sends wait for their results, so all of theirs shows;
- a pipeline's idle share (its bubble, ``Layout.bubble_fraction``) stretches the slowest stage.

The host (``host_time``): the CPU process that runs the step's Python and dispatches its ops. Its time is the
ops it dispatches eagerly (``StepCounts.host_ops``; the simulation counts them) at the cluster's ``host_op_us``,
and, in multiples of that op's time measured on one CPU (``HOST_COSTS``), each kernel and each call of compiled
code, each op DTensor dispatches, each FSDP module's hooks and the framework's own work per step (Lightning's
loop, its hooks, this project's callbacks). A GPU runs its kernels while the host queues the next, so the step is
the slower of the two; where the host waits for the device at each step's end (``step_checks=each_step``), the
framework's own work runs while the GPU idles and adds to it. A CPU both dispatches and computes: its step is the
sum.

The step is the slowest device's. What it leaves out: contention between overlapped collectives and compute, and
where Inductor cuts a fused chain in more kernels than needed.
"""

import math
from dataclasses import dataclass

from project.accounting.counts import Kernel, Link
from project.job.cluster import Cluster
from project.job.job import Job
from project.parallel.dims import DATA_PARALLEL
from project.plan.memory_plan import MemoryPlan
from project.plan.simulate import DevicePlan, GenerationPlan, generation_flops

GB = 1e9  # network and NVLink figures are decimal gigabytes per second, as datasheets give them
# NCCL's tuning model (src/graph/tuning.cc, ring algorithm, Simple protocol, the one that carries large buffers): a
# collective's base latency, and each step of its ring over NVLink and over the network, in microseconds.
NCCL_BASE_US = 8.4
NCCL_NVLINK_STEP_US = 3.4
NCCL_NETWORK_STEP_US = 9.6


def clock_ratio(cluster: Cluster) -> float:
    """The share of its peak clock a GPU sustains under its power limit: dynamic power grows with the clock times
    the voltage squared, and the voltage with the clock, so with the clock's cube. At its rated power (the
    datasheet's, at which its peak is specified) a GPU keeps the clock its efficiencies were measured at."""
    return min(1.0, (cluster.power_limit_w / cluster.rated_power_w) ** (1 / 3))


def wire_bytes(link: Link, size: int) -> float:
    """Bytes each rank sends for a collective whose whole buffer is ``size`` bytes, by ring (NCCL's bus
    bandwidth factors)."""
    n = link.ranks
    if link.kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return size * (n - 1) / n
    if link.kind == "all_reduce":
        return 2 * size * (n - 1) / n
    return size  # a send, a broadcast


def ring_latency(link: Link) -> float:
    """Seconds of latency of one collective, NCCL's way: a base, then a step per hop of its ring (n - 1 for an
    all-gather or reduce-scatter, twice that for an all-reduce), the hops between nodes at the network's cost."""
    steps, inter = (link.ranks - 1, link.nodes - 1) if link.kind != "send" else (1, int(link.nodes > 1))
    if link.kind == "all_reduce":
        steps, inter = 2 * steps, 2 * inter
    return (NCCL_BASE_US + (steps - inter) * NCCL_NVLINK_STEP_US + inter * NCCL_NETWORK_STEP_US) * 1e-6


def link_gb_per_s(link: Link, cluster: Cluster) -> float:
    """The bandwidth a rank's share of ``link``'s collective crosses: NVLink in one node. Across nodes, a ring
    collective (all-gather, reduce-scatter, all-reduce) runs as NCCL runs it, one ring a channel, each channel's
    ring crossing between nodes at a different GPU's network port: a group with k ranks on each node moves its bytes
    between nodes over k ports at once, each rank's NVLink the ceiling (NCCL's bus bandwidth across DGX nodes is
    their ports' sum). A send, or an all-to-all (whose bytes for other nodes leave by each rank's own port), has
    its rank's one port."""
    if link.nodes == 1:
        return cluster.intra_node_gb_per_s
    if link.kind in ("all_gather", "reduce_scatter", "all_reduce"):
        return min(cluster.intra_node_gb_per_s, cluster.inter_node_gb_per_s * (link.ranks // link.nodes))
    return cluster.inter_node_gb_per_s


def collective_seconds(link: Link, size: int, calls: int, cluster: Cluster) -> float:
    bandwidth = link_gb_per_s(link, cluster)
    latency = ring_latency(link) if cluster.collective_latency_us is None else cluster.collective_latency_us * 1e-6
    return calls * latency + wire_bytes(link, size) / (bandwidth * GB)


def flops_per_s(cluster: Cluster) -> float:
    """The GPU's dense BF16 peak at the clock its power limit allows."""
    return cluster.peak_tflops * 1e12 * clock_ratio(cluster)


def float8_flops_per_s(cluster: Cluster) -> float:
    """The GPU's dense FP8 peak at that clock (a cluster without one is refused for Float8 jobs before this)."""
    assert cluster.float8_peak_tflops is not None, f"{cluster.name} has no float8 peak"
    return cluster.float8_peak_tflops * 1e12 * clock_ratio(cluster)


def exponentials_per_s(cluster: Cluster) -> float:
    """The softmax exponentials the GPU's special-function units compute a second, at that clock."""
    return cluster.exp_tera_per_s * 1e12 * clock_ratio(cluster)


def _bytes_per_s(cluster: Cluster) -> float:
    return cluster.memory_tb_per_s * 1e12 * cluster.bandwidth_efficiency


def wave_share(tiles: int, multiprocessors: int) -> float:
    """The share of a GPU's multiprocessors a matmul of ``tiles`` output tiles keeps busy over its waves: its last
    wave runs the tiles left over (Nvidia's "wave quantization")."""
    return tiles / (math.ceil(tiles / multiprocessors) * multiprocessors) if tiles else 1.0


# A CPU's matmul packs its operands into blocks its cores multiply from, at every call: on the 2-core machine about
# as long as 16 rows of the product take (8 x 1024 x 256 ran at a third of the peak, 32 rows at two thirds, 64 rows at
# 0.72 to 0.86, 2048 at 0.98: calibrate --cpu's shapes, docs/step-time.md). A GPU's small matmul costs its tiles.
CPU_PACKING_ROWS = 16


def _arithmetic_seconds(kernel: Kernel, cluster: Cluster) -> float:
    """A kernel's arithmetic with its multiprocessors all busy: matmuls at ``matmul_efficiency`` (Float8's at
    ``float8_matmul_efficiency`` of the FP8 peak), a CPU's as if it had ``CPU_PACKING_ROWS`` more rows; attention's
    products at ``attention_efficiency`` (a causal kernel's half of them) and its exponentials at the special-function
    units' rate."""
    if kernel.kind == "float8_matmul":
        return kernel.flops / cluster.float8_matmul_efficiency / float8_flops_per_s(cluster)
    if kernel.kind == "matmul" and cluster.kind == "cpu" and kernel.rows:
        packed = (kernel.rows + CPU_PACKING_ROWS) / kernel.rows
        return packed * kernel.flops / cluster.matmul_efficiency / flops_per_s(cluster)
    if kernel.kind != "attention":
        return kernel.flops / cluster.matmul_efficiency / flops_per_s(cluster)
    done = 2 if kernel.causal else 1
    exponentials = kernel.exponentials / done / exponentials_per_s(cluster)
    return kernel.flops / done / cluster.attention_efficiency / flops_per_s(cluster) + exponentials


def kernel_seconds(kernel: Kernel, cluster: Cluster) -> float:
    """One kernel's roofline: the longer of its arithmetic (over its waves, for a matmul) and its bytes at the
    bandwidth."""
    arithmetic = _arithmetic_seconds(kernel, cluster)
    if kernel.kind != "attention":
        arithmetic /= wave_share(kernel.tiles, cluster.multiprocessors)
    return max(arithmetic, kernel.bytes / _bytes_per_s(cluster))


def compute_seconds(device: DevicePlan, cluster: Cluster) -> float:
    """A device's kernels, one after another: its matmuls and attention by their roofline, the bytes of every
    other op at the memory bandwidth."""
    kernels = sum(count * kernel_seconds(Kernel.parse(key), cluster) for key, count in device.kernels.items())
    return kernels + device.moved_bytes / _bytes_per_s(cluster)


def compute_floor(device: DevicePlan, cluster: Cluster) -> float:
    """The least ``compute_seconds`` a device of its work can take: each kernel's arithmetic with every
    multiprocessor busy and none bound by its bytes, and the other ops' bytes at the bandwidth. The layouts of one
    step share its arithmetic and (but for replicated ops) its bytes, whatever their shapes."""
    kernels = sum(count * _arithmetic_seconds(Kernel.parse(key), cluster) for key, count in device.kernels.items())
    return kernels + device.moved_bytes / _bytes_per_s(cluster)


@dataclass
class DeviceTime:
    """One device's step: its compute, its collectives that overlap the compute and those that do not, seconds."""

    compute: float
    overlapped: float
    critical: float

    @property
    def busy(self) -> float:
        return self.compute + self.critical + max(0.0, self.overlapped - self.compute)


def device_time(device: DevicePlan, cluster: Cluster, share: float = 1.0) -> DeviceTime:
    """``device``'s step on the cluster's device, or on ``share`` of it (a CPU's cores split between processes)."""
    compute = compute_seconds(device, cluster) / share
    overlapped = critical = 0.0
    for key, size in device.collectives.items():
        link = Link.parse(key)
        seconds = collective_seconds(link, size, device.collective_calls.get(key, 1), cluster)
        # Data parallelism's gathers and reductions run beside the compute; an expert-parallel all-to-all (also
        # over data-parallel ranks) carries the rows the next computation needs: it waits, as a send does. A CPU
        # computes and communicates with the same cores: nothing overlaps.
        if link.dim == DATA_PARALLEL and link.kind not in ("send", "all_to_all") and cluster.kind == "gpu":
            overlapped += seconds
        else:
            critical += seconds
    return DeviceTime(compute, overlapped, critical)


# The host's costs besides an eager op, in eager ops' worth of its time, on the 2-core CPU machine: measured there
# (``python benchmarks/host_costs.py``, the median of 6 rounds in two runs, on a net so narrow that its arithmetic is
# next to nothing; docs/step-time.md). A cluster may give its host's own (``Cluster.host_costs``): a GPU's eager op
# includes its launch, and its host's costs are other multiples of it (conf/step_time/roofline.yaml).
HOST_COSTS = {
    "compiled_kernels": 0.37,  # a kernel a compiled region launches
    "compiled_calls": 56.0,  # a call of compiled code (a block's forward or backward): guards, AOTAutograd's wrappers
    "dtensor": 0.79,  # a DTensor an op takes: DTensor's sharding propagation, in Python, beside the local op
    "fsdp_modules": 117.0,  # an FSDP module's four hooks in a step (its copies and collectives are ops of their own)
}
# The framework's own work per training step, besides the step's ops: Lightning's loop, closure and hooks, the
# callbacks, the next batch, the epoch metrics' updates. 0.69 ms a step of the default MLP on the 2-core CPU
# machine (benchmarks/step_breakdown.py, docs/speed.md), at its 5.15 us an op (calibrate --cpu).
FRAMEWORK_STEP_OPS = 134.0


@dataclass
class HostTime:
    """One device's host, seconds a step: dispatching the step's ops, and the framework's own work."""

    ops: float
    framework: float

    @property
    def total(self) -> float:
        return self.ops + self.framework


def host_time(device: DevicePlan, cluster: Cluster, ranks: int) -> HostTime:
    """``device``'s host a step, one of ``ranks``: its ops, and the framework's own work, which over several ranks
    includes their agreement on each step's flags (``StopTogether``: one all-reduce of two numbers, which a CPU's
    gloo waits for; a GPU's is queued, read a step late)."""
    op = cluster.host_op_us * 1e-6
    costs = cluster.host_costs or {**HOST_COSTS, "framework_step": FRAMEWORK_STEP_OPS}
    counts = device.host_ops
    eager = counts.get("eager", 0) + sum(costs[key] * counts.get(key, 0) for key in HOST_COSTS)
    framework = costs["framework_step"] * op
    if ranks > 1 and cluster.kind == "cpu" and cluster.collective_latency_us is not None:
        framework += cluster.collective_latency_us * 1e-6
    return HostTime(eager * op, framework)


def with_host(busy: float, host: HostTime, cluster: Cluster, waits: bool) -> float:
    """A step of ``busy`` device seconds with ``host``: on a CPU one after the other; on a GPU the slower of the
    two, but for the framework's work after a step's end when the host waits for the GPU there (``waits``)."""
    if cluster.kind == "cpu":
        return busy + host.total
    if waits:
        return max(busy, host.ops) + host.framework
    return max(busy, host.total)


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
    host: float = 0.0  # the host's seconds of the step (dispatch and the framework's own work)
    host_bound: float = 0.0  # what the step is longer for the host: the step less the device's alone
    generation: "GenerationTime | None" = None  # of ``seconds``, what the task draws inside the step


@dataclass
class GenerationTime:
    """A step's generation (``GenerationPlan``), seconds: gathering the model, the prompts' passes, the one-token
    passes, the reference's pass; the host's dispatch of the passes' ops, and what of it shows beyond the device's
    own time."""

    gather: float
    prompt_passes: float
    token_passes: float
    host: float
    host_bound: float
    reference_pass: float = 0.0

    @property
    def seconds(self) -> float:
        return self.gather + self.prompt_passes + self.token_passes + self.reference_pass


def predict_generation(generation: GenerationPlan, fsdp_units: int, cluster: Cluster, share: float) -> GenerationTime:
    """A step's generation on ``cluster`` (``share`` of a device: a CPU's cores split between processes). Each pass
    ends with its logits read on the host, where the next token is drawn: the next pass cannot be queued before,
    so a pass takes the longer of the device's time and the host's dispatch of its ops (on a CPU, their sum). The
    host's ops include each of the ``fsdp_units``' two forward hooks, half a step's four (``HOST_COSTS``)."""
    op = cluster.host_op_us * 1e-6
    costs = cluster.host_costs or HOST_COSTS
    hooks = fsdp_units * costs["fsdp_modules"] / 2 * op

    def seconds(work: DevicePlan) -> tuple[float, float, float]:
        busy = device_time(work, cluster, share).busy
        host = HostTime(host_time(work, cluster, 1).ops + hooks, 0.0)
        return with_host(busy, host, cluster, waits=False), busy, host.ops

    prompt, prompt_busy, prompt_host = seconds(generation.prompt_pass)
    token, token_busy, token_host = seconds(generation.token_pass)
    # The reference's pass, its model gathered (a gather's time and a pass's: counted together)
    reference, reference_busy, reference_host = (
        seconds(generation.reference_pass) if generation.reference_pass is not None else (0.0, 0.0, 0.0)
    )
    prompts, passes = generation.prompts, generation.prompts * (generation.new_tokens - 1)
    return GenerationTime(
        device_time(generation.gather, cluster, share).busy,
        prompts * prompt,
        passes * token,
        prompts * prompt_host + passes * token_host + reference_host,
        prompts * (prompt - prompt_busy) + passes * (token - token_busy) + reference - reference_busy,
        reference,
    )


def throughput_unit(job: Job) -> str:
    return "tokens" if job.seq_length else "samples"


def throughput_bound(job: Job, cluster: Cluster, compute: float) -> float:
    """The most tokens/s per device ``predict_step`` can give a layout whose devices' ``compute_floor`` is
    ``compute`` seconds on average: its slowest device computes at least that, and its step is at least that
    compute, with nothing exposed, stretched by its bubble."""
    dims = job.dims
    return job.tokens_per_step * dims.data_parallel / dims.world_size * (1 - job.layout.bubble_fraction()) / compute


def predict_step(plan: MemoryPlan, job: Job, cluster: Cluster) -> StepTime:
    """The step of ``job``'s layout, as ``plan`` counts it, on ``cluster``; its MFU counts the slowest device's
    FLOPs but activation checkpointing's recompute."""
    share = 1 / job.processes_per_node if cluster.kind == "cpu" else 1.0  # a CPU's cores split between processes
    times = [device_time(device, cluster, share) for device in plan.devices]
    bubble = job.layout.bubble_fraction()
    hosts = [host_time(device, cluster, plan.world_size) for device in plan.devices]
    waits = job.step_checks == "each_step"  # on GPUs ``auto`` reads each step's flags a step late
    steps = [with_host(time.busy / (1 - bubble), host, cluster, waits) for time, host in zip(times, hosts)]
    slowest = max(range(len(steps)), key=lambda index: steps[index])
    busy, seconds = times[slowest], steps[slowest]
    device_alone = busy.busy / (1 - bubble)
    tokens = job.tokens_per_step * job.dims.data_parallel / plan.world_size
    flops = plan.devices[slowest].flops - plan.devices[slowest].recomputed_flops
    drawn, host, host_bound = None, hosts[slowest].total, seconds - device_alone
    if plan.generation is not None:  # before the step's forward, on every device alike
        units = plan.devices[slowest].host_ops.get("fsdp_modules", 0)
        drawn = predict_generation(plan.generation, units, cluster, share)
        seconds += drawn.seconds
        host += drawn.host
        host_bound += drawn.host_bound
        flops += generation_flops(plan.generation)
    return StepTime(
        seconds,
        busy.compute,
        busy.busy - busy.compute,
        device_alone - busy.busy,
        tokens / seconds,
        flops / seconds / (cluster.peak_tflops * 1e12 * share),
        host,
        host_bound,
        drawn,
    )


def format_step(step: StepTime, cluster: Cluster, job: Job) -> str:
    """The step, and the forward pass the job's task makes once before its first step, if any (its
    ``precomputation``): about a third of the steps that would train on as many samples, a forward's share of a
    step's FLOPs (not simulated)."""
    line = (
        f"Predicted on {cluster.name}: {step.seconds:.3g} s a step ({step.compute:.3g} s compute, "
        f"{step.exposed_communication:.2g} s exposed communication, {step.bubble:.2g} s pipeline bubble, "
        f"{step.host_bound:.2g} s waiting on the host; the host's share {100 * step.host / step.seconds:.0f}%), "
        f"{step.tokens_per_device_per_s:,.0f} {throughput_unit(job)}/s per GPU, MFU {100 * step.mfu:.1f}% "
        "(docs/step-time.md)."
    )
    drawn, generation = step.generation, job.generation
    if drawn is not None and generation is not None:
        per_token = drawn.token_passes / job.batch_size / max(generation.new_tokens - 1, 1)
        line += (
            f" Of the step, generating takes {drawn.seconds:.3g} s: the prompts' passes {drawn.prompt_passes:.2g} s, "
            f"{generation.new_tokens - 1} passes of one token per prompt {drawn.token_passes:.3g} s "
            f"({1e3 * per_token:.2g} ms each), gathering the model {drawn.gather:.2g} s"
            + (f", the reference's pass {drawn.reference_pass:.2g} s" if drawn.reference_pass else "")
            + f"; {drawn.host_bound:.2g} s of it waiting on the host."
        )
    precomputation = job.model.task.precomputation
    if precomputation is not None:
        samples = precomputation.samples_forward(job.train_samples, job.val_samples)
        before = samples / job.samples_per_step * step.seconds / 3
        line += (
            f" Before the first step, one forward pass over {samples:,} samples (every {precomputation.sample}, for "
            f"{precomputation.task}'s {precomputation.name}): about {before:.3g} s, a third of the steps that would "
            "train on them."
        )
    return line
