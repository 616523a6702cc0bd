"""python -m project.cli.calibrate: measure this box's GPUs for the step-time model and write them as a cluster.

On a GPU box, in under two minutes: BF16 matmuls of a model's shapes, fused causal attention, the memory bandwidth
of a copy, the host's time per eager op (a tiny model's step, which waits for the host), and (with several GPUs) an
NCCL all-gather across them. From those, the model's three efficiencies (``project.plan.step_time``: what share of
the datasheet's figures each kind of kernel reaches), the host's speed (``host_op_us``), and the box's own
multiprocessors, memory, power limit and NVLink bandwidth, over the datasheet cluster of its GPU (``--base``). The
file goes to ``conf/cluster/<name>.yaml``: ``python train.py plan=search cluster=<name> ...`` then predicts with it.
Without a GPU it refuses; ``--smoke`` runs the same code on the CPU at small sizes (two gloo processes for the
all-gather), to check it where no GPU is at hand: its figures are the CPU's. ``--cpu`` measures this machine's CPU
as the device that trains (``kind: cpu``; its float32 peak and bandwidth measured, no datasheet under it), so that
``plan=true cluster=<name>`` predicts its CPU jobs: ``conf/cluster/cpu_2core.yaml`` is this project's machine's.
"""

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from project.accounting.counts import Kernel
from project.cli.usage import run_cli
from project.job.cluster import Cluster
from project.options.errors import ConfigError, check_writable
from project.options.writes import written
from project.plan.step_time import exponentials_per_s, flops_per_s, kernel_seconds

CONF = Path(__file__).resolve().parents[2] / "conf"
# The datasheet cluster of each GPU, by a part of its name (torch.cuda.get_device_name), the more specific first.
BASES = [("H200", "h200_8x"), ("H100", "h100_sxm_8x"), ("A100", "a100_80g_8x")]
# Llama 3.1 8B's matmuls at 8,192 tokens (M x N x K): its attention projections, its MLP's, and its output layer.
MODEL_SHAPES = ["8192x4096x4096", "8192x1024x4096", "8192x14336x4096", "8192x4096x14336", "8192x128256x4096"]
MODEL_SEQ = 8192  # attention's sequence length: Llama 3 8B's training sequence


@dataclass(frozen=True)
class Sizes:
    """What a calibration times: on ``device``, BF16 matmuls of ``shapes`` (MxNxK), causal attention of ``heads``
    heads of ``head_dim`` over ``seq`` tokens, a copy of ``copy_bytes``, and an all-gather of ``gather_bytes``
    across the box's devices over ``backend``."""

    device: str
    shapes: list[str]
    seq: int
    heads: int = 32
    head_dim: int = 128  # Llama 3's
    copy_bytes: int = 2**31
    gather_bytes: int = 2**28
    backend: str = "nccl"
    dtype: torch.dtype = torch.bfloat16  # of the matmuls and attention: what the device's jobs compute in


# --smoke: the same code on this machine's CPU at sizes it times in seconds, gathering over 2 gloo processes: a check
# of the code and the file where no GPU is at hand (its figures are the CPU's).
SMOKE = Sizes(
    "cpu", ["256x256x256", "256x512x256"], seq=256, heads=4, head_dim=32, copy_bytes=2**23, gather_bytes=2**20,
    backend="gloo",
)  # fmt: skip


# --cpu: this machine's CPU as the device that trains (its jobs compute in float32): the matmuls of the default MLP's
# and the tiny GPT's shapes, a 256 MiB copy, a 16 MiB all-gather over 2 gloo processes.
CPU = Sizes(
    "cpu", ["64x1024x256", "64x512x1024", "2048x384x128", "2048x128x512"], seq=256, heads=4, head_dim=32,
    copy_bytes=2**28, gather_bytes=2**24, backend="gloo", dtype=torch.float32,
)  # fmt: skip


@dataclass
class Measured:
    """What a calibration measured, beside the base cluster's datasheet figures it replaces."""

    device: str  # the GPU's name
    devices: int  # GPUs on the box
    multiprocessors: int
    memory_gb: float
    power_limit_w: float | None  # nvidia-smi's; None where it cannot say
    matmul_efficiency: float
    attention_efficiency: float
    bandwidth_efficiency: float
    intra_node_gb_per_s: float | None  # None with one GPU: nothing to measure between GPUs
    notes: dict[str, str]  # what each measured figure came from, for the file's comments
    host_op_us: float | None = None  # the host's time per eager op; None: the base's
    collective_latency_us: float | None = None  # gloo's (a CPU); None: NCCL's model


def _figure(value: float) -> float:
    """Three significant figures: a measurement's own precision, and never 0 for a small share."""
    return float(f"{value:.3g}")


def cluster_file(name: str, base: Cluster, measured: Measured) -> str:
    """The YAML of a calibrated cluster: the base's datasheet figures, the measured ones over them, each commented
    with where it came from."""
    values = {field.name: getattr(base, field.name) for field in fields(Cluster)}
    values.update(
        name=name,
        multiprocessors=measured.multiprocessors,
        memory_gb=round(measured.memory_gb, 1),
        matmul_efficiency=_figure(measured.matmul_efficiency),
        attention_efficiency=_figure(measured.attention_efficiency),
        bandwidth_efficiency=_figure(measured.bandwidth_efficiency),
        devices_per_node=measured.devices if measured.devices > 1 else base.devices_per_node,
    )
    if measured.power_limit_w is not None:
        values["power_limit_w"] = measured.power_limit_w
    if measured.host_op_us is not None:
        values["host_op_us"] = _figure(measured.host_op_us)
    if measured.collective_latency_us is not None:
        values["collective_latency_us"] = _figure(measured.collective_latency_us)
    if measured.intra_node_gb_per_s is not None:
        values["intra_node_gb_per_s"] = _figure(measured.intra_node_gb_per_s)
    today = datetime.date.today().isoformat()
    unmeasured = "none: every figure is measured" if base.kind == "cpu" else f"{base.name}'s (its datasheets)"
    lines = [
        f"# Measured by python -m project.cli.calibrate on {today}: {measured.devices} x {measured.device}, torch",
        f"# {torch.__version__}; the figures not measured: {unmeasured}. Use: cluster={name}.",
        "defaults:",
        "  - /step_time/roofline@_here_  # the model's efficiencies, replaced below by this box's",
        "  - _self_",
    ]
    for key, value in values.items():
        note = measured.notes.get(key, f"{base.name}'s" if key != "name" else "the cluster= option that picks it")
        lines.append(f"{key}: {'null' if value is None else value}  # {note}")
    return "\n".join(lines) + "\n"


def _seconds(run: Callable[[], object], device: str, repeats: int = 10) -> float:
    """Median seconds of ``run`` after warm-up runs: on a GPU by CUDA events, on the CPU by the wall clock."""
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begun = time.perf_counter()
            run()
            times.append(time.perf_counter() - begun)
    return sorted(times)[len(times) // 2]


def measure_matmuls(sizes: Sizes, cluster: Cluster) -> tuple[float, str]:
    """The median share of the peak the shapes' BF16 matmuls reach, where the step-time model prices them at the
    peak (at the clock's ratio, over each shape's waves; a CPU's with packing), and each shape's TFLOPS."""
    at_peak = dataclasses.replace(cluster, matmul_efficiency=1.0)
    shares, reached = [], []
    for shape in sizes.shapes:
        m, n, k = (int(size) for size in shape.split("x"))
        a = torch.randn(m, k, device=sizes.device, dtype=sizes.dtype)
        b = torch.randn(k, n, device=sizes.device, dtype=sizes.dtype)
        seconds = _seconds(functools.partial(torch.matmul, a, b), sizes.device)
        tiles = math.ceil(m / Kernel.TILE) * math.ceil(n / Kernel.TILE)
        shares.append(kernel_seconds(Kernel("matmul", 2 * m * n * k, 0, tiles, rows=m), at_peak) / seconds)
        reached.append(f"{shape} {2 * m * n * k / seconds / 1e12:.3g}")
    return sorted(shares)[len(shares) // 2], "TFLOPS " + ", ".join(reached)


def measure_attention(sizes: Sizes, cluster: Cluster) -> tuple[float, str]:
    """The share of the peak causal attention's products reach, forward and backward, its exponentials' time taken
    out as the model prices them."""
    shape = (1, sizes.heads, sizes.seq, sizes.head_dim)
    q, k, v = (torch.randn(shape, device=sizes.device, dtype=sizes.dtype, requires_grad=True) for _ in "qkv")

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    seconds = _seconds(step, sizes.device)
    scores = sizes.heads * sizes.seq**2 / 2  # a causal kernel's half
    products = (4 + 10) * scores * sizes.head_dim  # torch's formulas: 2 products forward, 5 backward
    exponentials = 2 * scores  # one per score, forward and again in backward
    arithmetic = seconds - exponentials / exponentials_per_s(cluster)
    share = products / max(arithmetic, 1e-9) / flops_per_s(cluster)
    where = f"causal, {sizes.heads} heads of {sizes.head_dim}, sequence {sizes.seq}"
    return share, f"{where}: {seconds * 1e3:.1f} ms forward and backward"


def measure_bandwidth(sizes: Sizes, cluster: Cluster) -> tuple[float, str]:
    """The share of the datasheet's memory bandwidth a copy reaches (it reads and writes each byte)."""
    source = torch.empty(sizes.copy_bytes // 2, device=sizes.device, dtype=torch.bfloat16)
    target = torch.empty_like(source)
    seconds = _seconds(lambda: target.copy_(source), sizes.device)
    bandwidth = 2 * sizes.copy_bytes / seconds
    copied = f"a copy of {sizes.copy_bytes / 2**20:,.0f} MiB"
    return bandwidth / (cluster.memory_tb_per_s * 1e12), f"{copied}: {bandwidth / 1e12:.2f} TB/s"


def _host_bound_step(device: str, width: int) -> Callable[[], None]:
    """A step (forward, backward, fused AdamW) of a GPT of 2 blocks of ``width`` on 2 sequences of 16 tokens, so
    small that the device waits for the host."""
    from project.models import GPT, init_weights

    net = init_weights(GPT(vocab_size=64, max_length=16, num_layers=2, dim=width, num_heads=4), 0).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), fused=True)
    tokens = torch.randint(0, 64, (2, 16), device=device)

    def step() -> None:
        F.cross_entropy(net(tokens).flatten(0, 1), tokens.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def measure_host(device: str) -> tuple[float, str]:
    """The host's microseconds per eager op: a host-bound step (``_host_bound_step``; ``benchmarks/host_costs.py``
    measures the host's other costs in this op's units, on this step), its ops counted as the memory plan counts
    them (``StepCounts``), timed over 50 steps (on a GPU, to the end of their kernels)."""
    from project.accounting.counts import StepCounts

    # Width 16: on a CPU the ops' arithmetic next to nothing, which the model prices as the CPU's compute (a wider
    # net's would count twice)
    step = _host_bound_step(device, width=16)
    step()  # the optimizer's state made: counted from the second step, as the plan counts
    counts = StepCounts(devices_per_node=1, world_dim="world")
    with counts:
        step()
    ops = counts.host_ops["eager"]

    def steps() -> None:
        for _ in range(50):
            step()

    seconds = _seconds(steps, device, repeats=5)
    return seconds / 50 / ops * 1e6, f"a tiny GPT's step of {ops} eager ops: {seconds / 50 * 1e3:.2f} ms"


def _latency_between_busy_ranks(flag: torch.Tensor) -> float:
    """Seconds an all-reduce of ``flag`` adds to each step of host-bound work on every rank (CPU processes).

    Back to back, two gloo processes all-reduce a number in some 0.2 ms on the 2-core machine; after each rank's
    own work, as in training, the same collective waits for the later rank and wakes gloo's sleeping threads: 0.5
    to 1 ms there (docs/step-time.md). Interleaved rounds of 10 steps without and with it, the median difference."""
    import torch.distributed as dist

    step = _host_bound_step("cpu", width=128)  # each rank's own work as long as a small model's step

    def steps(collective: bool) -> float:
        dist.barrier()
        begun = time.perf_counter()
        for _ in range(10):
            step()
            if collective:
                dist.all_reduce(flag)
        return time.perf_counter() - begun

    steps(True)  # warm-up: the optimizer's state, gloo's buffers
    added = [steps(True) - steps(False) for _ in range(40)]
    return max(0.0, sorted(added)[len(added) // 2] / 10)


def _all_gather_rank(rank: int, world: int, sizes: Sizes, init: str, result: str) -> None:
    import torch.distributed as dist

    # torch 2.13 renames it all_gather_single; the GPU boxes' torch 2.11 has only this name
    warnings.filterwarnings("ignore", "`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning)
    if sizes.device == "cuda":
        torch.cuda.set_device(rank)
    else:  # the processes share the cores, as training's do
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group(sizes.backend, init_method=init, rank=rank, world_size=world)
    shard = torch.empty(sizes.gather_bytes // world, device=sizes.device, dtype=torch.uint8)
    gathered = torch.empty(shard.numel() * world, device=sizes.device, dtype=torch.uint8)
    seconds = _seconds(lambda: dist.all_gather_into_tensor(gathered, shard), sizes.device)
    flag = torch.zeros(1, device=sizes.device)
    if sizes.device == "cpu":
        latency = _latency_between_busy_ranks(flag)
    else:  # a GPU's collective of next to nothing, queued behind nothing
        latency = _seconds(lambda: dist.all_reduce(flag), sizes.device, repeats=50)
    if rank == 0:  # a rank's bytes on the wire a second, and the latency
        Path(result).write_text(json.dumps([gathered.numel() * (world - 1) / world / seconds, latency]))
    dist.destroy_process_group()


def measure_nvlink(devices: int, sizes: Sizes) -> tuple[float, str, float]:
    """Each device's bandwidth each way in an all-gather across the box's devices (GB/s, ring bytes), and the
    microseconds of an all-reduce of one number."""
    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "bandwidth")
        init = f"file://{Path(tmp) / 'rendezvous'}"
        torch.multiprocessing.spawn(_all_gather_rank, args=(devices, sizes, init, result), nprocs=devices)
        bandwidth, latency = json.loads(Path(result).read_text())
    gather = f"an all-gather ({sizes.backend}) of {sizes.gather_bytes / 2**20:,.0f} MiB over {devices} devices"
    return bandwidth / 1e9, f"{gather}: {bandwidth / 1e9:.1f} GB/s a device each way", latency * 1e6


def power_limit() -> float | None:
    """The first GPU's power limit in watts, from nvidia-smi (None where it is missing or says nothing)."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=power.limit", "--format=csv,noheader,nounits", "--id=0"]
    reply = subprocess.run(query, capture_output=True, text=True, check=False).stdout.strip()
    return float(reply) if re.fullmatch(r"[\d.]+", reply) else None


def base_cluster(name: str | None, device: str) -> Cluster:
    """The datasheet cluster ``--base`` names, or the one of this GPU."""
    if name is None:
        name = next((base for part, base in BASES if part in device), None)
        if name is None:
            options = " | ".join(path.stem for path in sorted((CONF / "cluster").glob("*.yaml")))
            raise ConfigError("--base", f"no datasheet cluster is known for a {device}.", f"name one: {options}.")
    path = CONF / "cluster" / f"{name}.yaml"
    if not path.exists():
        raise ConfigError("--base", f"{path} does not exist.", "name a file of conf/cluster.")
    # The file's defaults list, as Hydra composes it: the shared efficiencies, then the file's own keys.
    config = OmegaConf.merge(OmegaConf.load(CONF / "step_time" / "roofline.yaml"), OmegaConf.load(path))
    return Cluster.of(cast(DictConfig, config))


def calibrate(base_name: str | None, sizes: Sizes) -> tuple[Cluster, Measured]:
    """This box measured over its datasheet cluster: on its GPUs, or with ``SMOKE`` sizes on the CPU."""
    if sizes.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device",
            "calibrate times this machine's GPUs, and torch sees no CUDA device here.",
            "run it on the GPU box (make gpu-check runs it); without a GPU, plan with a datasheet cluster: "
            "cluster=h100_sxm_8x | h200_8x | a100_80g_8x (or check this command's code with --smoke).",
        )
    gpu = sizes.device == "cuda"
    device = torch.cuda.get_device_name(0) if gpu else "CPU (--smoke)"
    base = base_cluster(base_name if base_name or gpu else "h100_sxm_8x", device)
    limit = power_limit() if gpu else None
    # The efficiencies are shares of the peak at the clock this box's power limit allows.
    box = dataclasses.replace(base, power_limit_w=limit or base.power_limit_w)
    if gpu:
        box = dataclasses.replace(box, multiprocessors=torch.cuda.get_device_properties(0).multi_processor_count)
    matmul, matmul_note = measure_matmuls(sizes, box)
    attention, attention_note = measure_attention(sizes, box)
    bandwidth, bandwidth_note = measure_bandwidth(sizes, box)
    host, host_note = measure_host(sizes.device)
    devices = torch.cuda.device_count() if gpu else 2
    nvlink, nvlink_note, latency = measure_nvlink(devices, sizes) if devices > 1 else (None, "", None)
    notes = {
        "multiprocessors": "this GPU's (torch.cuda.get_device_properties)" if gpu else f"{base.name}'s",
        "memory_gb": "this GPU's" if gpu else f"{base.name}'s",
        "power_limit_w": "nvidia-smi's power limit" if limit is not None else f"{base.name}'s (no nvidia-smi)",
        "matmul_efficiency": f"the median share over {len(sizes.shapes)} shapes: {matmul_note}",
        "attention_efficiency": attention_note,
        "bandwidth_efficiency": bandwidth_note,
        "devices_per_node": "this box's devices" if devices > 1 else f"{base.name}'s (one GPU here)",
        "intra_node_gb_per_s": nvlink_note or f"{base.name}'s (one GPU here: nothing to measure between GPUs)",
        "host_op_us": host_note,
    }
    memory = torch.cuda.get_device_properties(0).total_memory / 1e9 if gpu else base.memory_gb
    measured = Measured(
        device, devices, box.multiprocessors, memory, limit, matmul, attention, bandwidth, nvlink, notes, host
    )  # fmt: skip
    return base, measured


def _shape(shape: str) -> tuple[int, int, int]:
    m, n, k = (int(size) for size in shape.split("x"))
    return m, n, k


def with_backward(shapes: list[str]) -> list[str]:
    """Each MxNxK matmul (a Linear's forward) and the two of its backward: the input's gradient (MxKxN) and the
    weight's (NxKxM), which a CPU runs from transposed operands, often slower."""
    triples = [_shape(shape) for shape in shapes]
    return [f"{a}x{b}x{c}" for m, n, k in triples for a, b, c in ((m, n, k), (m, k, n), (n, k, m))]


def calibrate_cpu(sizes: Sizes) -> tuple[Cluster, Measured]:
    """This machine's CPU as the device that trains: its float32 peak (a large matmul's rate), its copy
    bandwidth and exponentials a second, then the efficiencies of ``sizes``' shapes against those, its host's op
    and a gloo collective's latency between two processes. No power model: a CPU's clock is what it is."""
    cores = len(os.sched_getaffinity(0))
    rates = []
    for m, n, k in [(2048, 2048, 2048)] + [_shape(shape) for shape in sizes.shapes]:
        a, b = torch.randn(m, k), torch.randn(k, n)
        rates.append(2 * m * n * k / _seconds(functools.partial(torch.matmul, a, b), "cpu") / 1e12)
    peak = max(rates)  # the fastest: the efficiencies are shares of it
    source = torch.empty(sizes.copy_bytes // 4)
    target = torch.empty_like(source)
    memory = 2 * sizes.copy_bytes / _seconds(lambda: target.copy_(source), "cpu") / 1e12
    exps = source.numel() / _seconds(lambda: torch.exp(source, out=target), "cpu") / 1e12
    roofline = OmegaConf.load(CONF / "step_time" / "roofline.yaml")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    base = Cluster(
        "cpu", "cpu", _figure(peak), None, round(ram, 1), _figure(memory), cores, _figure(exps), 1.0, 1.0, cores,
        1.0, 1.0, 1.0, roofline.float8_matmul_efficiency, 1.0, 1.0, roofline.host_op_us, None,
    )  # fmt: skip
    # Shares of this CPU's own figures, measured a moment apart: at most 1 (a busy CPU's figures vary)
    matmul, matmul_note = measure_matmuls(dataclasses.replace(sizes, shapes=with_backward(sizes.shapes)), base)
    attention, attention_note = measure_attention(sizes, base)
    bandwidth, bandwidth_note = measure_bandwidth(sizes, base)
    matmul, attention, bandwidth = (min(1.0, share) for share in (matmul, attention, bandwidth))
    host, host_note = measure_host("cpu")
    gloo, gloo_note, latency = measure_nvlink(2, sizes)
    notes = {
        "kind": "a CPU that trains",
        "peak_tflops": "the fastest float32 matmul's TFLOPS (2048x2048x2048 and the shapes below), all cores",
        "float8_peak_tflops": "none on a CPU",
        "memory_gb": "this machine's memory",
        "memory_tb_per_s": f"a copy of {sizes.copy_bytes / 2**20:,.0f} MiB",
        "multiprocessors": "its cores (os.sched_getaffinity)",
        "exp_tera_per_s": "torch.exp over the copy's float32 numbers",
        "rated_power_w": "no power model for a CPU",
        "power_limit_w": "no power model for a CPU",
        "devices_per_node": "its cores: at most a process per core",
        "inter_node_gb_per_s": "as within the machine",
        "matmul_efficiency": f"the median share of the peak, packing priced, over {len(sizes.shapes)} Linear layers' "
        f"matmuls, forward and backward: {matmul_note}",
        "attention_efficiency": attention_note,
        "bandwidth_efficiency": bandwidth_note,
        "intra_node_gb_per_s": gloo_note,
        "host_op_us": host_note,
        "collective_latency_us": "an all-reduce of one number between 2 gloo processes, each after its own work",
        "host_costs": "null: the 2-core CPU machine's, in its eager ops (HOST_COSTS, benchmarks/host_costs.py)",
        "float8_matmul_efficiency": "the model's (no float8 on a CPU)",
    }
    measured = Measured(
        f"CPU of {cores} cores", 1, cores, base.memory_gb, None, matmul, attention, bandwidth, gloo, notes, host,
        latency,
    )  # fmt: skip
    return dataclasses.replace(base, inter_node_gb_per_s=_figure(gloo)), measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m project.cli.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--name", help="the cluster's name (default: calibrated_<GPU>_<GPUs>x)")
    parser.add_argument("--out", help="the file to write (default: conf/cluster/<name>.yaml)")
    parser.add_argument("--base", help="the datasheet cluster of this GPU (default: found by its name)")
    parser.add_argument("--shapes", nargs="+", default=MODEL_SHAPES, help="matmuls to time, MxNxK (default: 8B's)")
    parser.add_argument("--seq", type=int, default=MODEL_SEQ, help=f"attention's sequence length (default {MODEL_SEQ})")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="run the same code on this CPU at small sizes (a check, not a GPU's figures)",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="measure this CPU as the device that trains (its jobs' plan=true cluster=<name> then predicts them)",
    )
    args = parser.parse_args(argv)
    for shape in args.shapes:
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*x[1-9]\d*", shape):
            raise ConfigError("--shapes", f"{shape!r} is not MxNxK.", "give positive sizes such as 8192x4096x4096.")
    own_sizes = "--smoke" if args.smoke else "--cpu" if args.cpu else None
    if own_sizes and (args.shapes != MODEL_SHAPES or args.seq != MODEL_SEQ):
        raise ConfigError(
            "--shapes" if args.shapes != MODEL_SHAPES else "--seq",
            f"is given with {own_sizes}, which times sizes of its own on the CPU.",
            f"leave it out with {own_sizes}, or run on a GPU box without it to time these.",
        )
    if args.cpu and (args.smoke or args.base):
        raise ConfigError(
            "--smoke" if args.smoke else "--base",
            "is given with --cpu, which measures this CPU itself (no datasheet cluster under it).",
            "give --cpu alone (with --name and --out if you like).",
        )
    if (
        args.name is not None
        and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.name)
        or ".." in (args.name or "")
    ):
        raise ConfigError(
            "--name",
            f"is {args.name!r}: the cluster's name, which makes its file conf/cluster/<name>.yaml and cluster=<name>.",
            "give a plain name of letters, digits, '_', '-' and '.', e.g. --name my_h100s (--out chooses the file).",
        )
    if args.cpu:
        base, measured = calibrate_cpu(CPU)
    else:
        base, measured = calibrate(args.base, SMOKE if args.smoke else Sizes("cuda", args.shapes, args.seq))
    slug = re.sub(r"[^a-z0-9]+", "_", measured.device.lower().removeprefix("nvidia ")).strip("_")
    name = args.name or f"calibrated_{slug}_{measured.devices}x"
    out = Path(args.out or CONF / "cluster" / f"{name}.yaml")
    check_writable("--out", out.parent, "give a file path in a dir you can write.")
    with written(out, "cluster file", "free space or give another --out.") as path:
        path.write_text(cluster_file(name, base, measured))
    print(Path(out).read_text(), end="")
    print(f"Wrote {out}: use cluster={name}" + ("" if out.parent == CONF / "cluster" else f" (from {out.parent})"))


if __name__ == "__main__":
    run_cli("python -m project.cli.calibrate", main)
