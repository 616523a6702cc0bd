"""python -m project.cli.calibrate: measure this box's GPUs for the step-time model and write them as a cluster.

On a GPU box, in under two minutes: BF16 matmuls of a model's shapes, fused causal attention, the memory bandwidth
of a copy, and (with several GPUs) an NCCL all-gather across them. From those, the model's three efficiencies
(``project.plan.step_time``: what share of the datasheet's figures each kind of kernel reaches), and the box's own
multiprocessors, memory, power limit and NVLink bandwidth, over the datasheet cluster of its GPU (``--base``). The
file goes to ``conf/cluster/<name>.yaml``: ``python train.py plan=search cluster=<name> ...`` then predicts with it.
Without a GPU it refuses; ``--smoke`` runs the same code on the CPU at small sizes (two gloo processes for the
all-gather), to check it where no GPU is at hand: its figures are the CPU's.
"""

import argparse
import dataclasses
import datetime
import functools
import math
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
from project.plan.step_time import exponentials_per_s, flops_per_s, wave_share

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


# --smoke: the same code on this machine's CPU at sizes it times in seconds, gathering over 2 gloo processes: a check
# of the code and the file where no GPU is at hand (its figures are the CPU's).
SMOKE = Sizes(
    "cpu", ["256x256x256", "256x512x256"], seq=256, heads=4, head_dim=32, copy_bytes=2**23, gather_bytes=2**20,
    backend="gloo",
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
    if measured.intra_node_gb_per_s is not None:
        values["intra_node_gb_per_s"] = _figure(measured.intra_node_gb_per_s)
    today = datetime.date.today().isoformat()
    lines = [
        f"# Measured by python -m project.cli.calibrate on {today}: {measured.devices} x {measured.device}, torch",
        f"# {torch.__version__}; the figures not measured are {base.name}'s (its datasheets). Use: cluster={name}.",
        "defaults:",
        "  - /step_time/roofline@_here_  # the model's efficiencies, replaced below by this box's",
        "  - _self_",
    ]
    for key, value in values.items():
        note = measured.notes.get(key, f"{base.name}'s" if key != "name" else "the cluster= option that picks it")
        lines.append(f"{key}: {value}  # {note}")
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
    """The median share of the peak (at the clock's ratio, over each shape's waves) the shapes' BF16 matmuls reach,
    and each shape's TFLOPS."""
    rate = flops_per_s(cluster)
    shares, reached = [], []
    for shape in sizes.shapes:
        m, n, k = (int(size) for size in shape.split("x"))
        a = torch.randn(m, k, device=sizes.device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=sizes.device, dtype=torch.bfloat16)
        seconds = _seconds(functools.partial(torch.matmul, a, b), sizes.device)
        tiles = math.ceil(m / Kernel.TILE) * math.ceil(n / Kernel.TILE)
        shares.append(2 * m * n * k / seconds / rate / wave_share(tiles, cluster.multiprocessors))
        reached.append(f"{shape} {2 * m * n * k / seconds / 1e12:.3g}")
    return sorted(shares)[len(shares) // 2], "TFLOPS " + ", ".join(reached)


def measure_attention(sizes: Sizes, cluster: Cluster) -> tuple[float, str]:
    """The share of the peak causal attention's products reach, forward and backward, its exponentials' time taken
    out as the model prices them."""
    shape = (1, sizes.heads, sizes.seq, sizes.head_dim)
    q, k, v = (torch.randn(shape, device=sizes.device, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")

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


def _all_gather_rank(rank: int, world: int, sizes: Sizes, init: str, result: str) -> None:
    import torch.distributed as dist

    # torch 2.13 renames it all_gather_single; the GPU boxes' torch 2.11 has only this name
    warnings.filterwarnings("ignore", "`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning)
    if sizes.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(sizes.backend, init_method=init, rank=rank, world_size=world)
    shard = torch.empty(sizes.gather_bytes // world, device=sizes.device, dtype=torch.uint8)
    gathered = torch.empty(shard.numel() * world, device=sizes.device, dtype=torch.uint8)
    seconds = _seconds(lambda: dist.all_gather_into_tensor(gathered, shard), sizes.device)
    if rank == 0:
        Path(result).write_text(str(gathered.numel() * (world - 1) / world / seconds))  # a rank's bytes on the wire
    dist.destroy_process_group()


def measure_nvlink(devices: int, sizes: Sizes) -> tuple[float, str]:
    """Each device's bandwidth each way in an all-gather across the box's devices (GB/s, ring bytes)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = str(Path(tmp) / "bandwidth")
        init = f"file://{Path(tmp) / 'rendezvous'}"
        torch.multiprocessing.spawn(_all_gather_rank, args=(devices, sizes, init, result), nprocs=devices)
        bandwidth = float(Path(result).read_text()) / 1e9
    gather = f"an all-gather ({sizes.backend}) of {sizes.gather_bytes / 2**20:,.0f} MiB over {devices} devices"
    return bandwidth, f"{gather}: {bandwidth:.1f} GB/s a device each way"


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
    devices = torch.cuda.device_count() if gpu else 2
    nvlink, nvlink_note = measure_nvlink(devices, sizes) if devices > 1 else (None, "")
    notes = {
        "multiprocessors": "this GPU's (torch.cuda.get_device_properties)" if gpu else f"{base.name}'s",
        "memory_gb": "this GPU's" if gpu else f"{base.name}'s",
        "power_limit_w": "nvidia-smi's power limit" if limit is not None else f"{base.name}'s (no nvidia-smi)",
        "matmul_efficiency": f"the median share over {len(sizes.shapes)} shapes: {matmul_note}",
        "attention_efficiency": attention_note,
        "bandwidth_efficiency": bandwidth_note,
        "devices_per_node": "this box's devices" if devices > 1 else f"{base.name}'s (one GPU here)",
        "intra_node_gb_per_s": nvlink_note or f"{base.name}'s (one GPU here: nothing to measure between GPUs)",
    }
    memory = torch.cuda.get_device_properties(0).total_memory / 1e9 if gpu else base.memory_gb
    measured = Measured(
        device, devices, box.multiprocessors, memory, limit, matmul, attention, bandwidth, nvlink, notes
    )  # fmt: skip
    return base, measured


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
    args = parser.parse_args(argv)
    for shape in args.shapes:
        if not re.fullmatch(r"[1-9]\d*x[1-9]\d*x[1-9]\d*", shape):
            raise ConfigError("--shapes", f"{shape!r} is not MxNxK.", "give positive sizes such as 8192x4096x4096.")
    if args.smoke and (args.shapes != MODEL_SHAPES or args.seq != MODEL_SEQ):
        raise ConfigError(
            "--shapes" if args.shapes != MODEL_SHAPES else "--seq",
            "is given with --smoke, which times small sizes of its own on the CPU (a check of the code).",
            "leave it out with --smoke, or run on a GPU box without --smoke to time these.",
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
