"""The step-time model against measured throughput: the figures of docs/step-time.md.

    python benchmarks/step_time.py          # every row, about a minute on 2 CPU cores
    python benchmarks/step_time.py 8b       # our own rows and the Llama 3.1 8B rows only
    python benchmarks/step_time.py own      # our own rows only
    python benchmarks/step_time.py megatron # our own rows and Megatron-LM's weak-scaling table, about 10 minutes
    python benchmarks/step_time.py --refit  # the efficiencies and the host's speed fitted again too (below)
    python benchmarks/step_time.py --refit gpu_collect.json  # ... on what make gpu-collect measured instead
    python benchmarks/step_time.py --cpu-host-costs  # the H200 rows with the CPU machine's host costs (below)

First our own runs on one H200 (docs/gpu.md: the GPU benchmark's gpt_350m and llama_1b, eager and compiled). The
model's three efficiencies (conf/step_time/roofline.yaml) were fitted on them: the values, on a grid of 0.01, that
make the largest error smallest (``--refit`` fits them again; without it they are conf/step_time/roofline.yaml's,
docs/step-time.md says why). The host's speed (``host_op_us``) was fitted on the compiled gpt_350m's row, whose pace
the host then set; the device sets it since compiled blocks are priced by inductor's kernels, so ``--refit`` keeps
roofline.yaml's unless a fitted row pins it (``fit_host``: a fit at the grid's end is none); gpt_125m's rows, set by
the host, check it. ``--cpu-host-costs`` prices our rows with the 2-core CPU machine's own host costs
(``HOST_COSTS``, ``cluster.host_costs: null``) instead of roofline.yaml's, the host's speed fitted to make the
largest error of all our rows smallest: why the GPU clusters keep roofline.yaml's. Then Float8's matmul efficiency
was fitted on the one Float8 run (again with ``--refit``: the measured runs predate the compiled loss, which the
model now prices, so a fit today would put the loss's gain down to Float8's matmuls). Then torchtitan's
published throughput (docs/performance.md of pytorch/torchtitan, at its commit 820504e of 2025-06-13, and the A100
tables of its earlier version), each row predicted with the fitted efficiencies and its hardware's datasheet
cluster, and torchtitan's model and loss as they ran (``torchtitan_llama``): nothing is fitted to those rows.
``megatron`` predicts Megatron-LM's weak-scaling table instead (Narayanan et al., SC'21, Table 1: GPT from 1.7B to
1T parameters on 32 to 3,072 A100s, tensor, pipeline and data parallel), each row's TFLOP/s turned into tokens/s by
the paper's own FLOP count (``megatron_tokens_per_s``).

``--refit FILE`` fits them on a ``make gpu-collect`` JSON instead (``scripts/gpu_collect.py``; ``collected``): its
bf16 cases of gpt_350m and llama_1b fit the three efficiencies, its Float8 cases Float8's, its host-bound cases
(the tiny GPT's and gpt_125m's) the host's speed; each case planned on its GPU's datasheet cluster, as measured
(the file's overrides, ``step_checks`` as the run had it); the peer trainer's throughput is printed beside.

Each row's layout is planned as ``plan=search`` plans it (``extrapolated_plan``: the counts the step time reads are
exactly the whole simulation's). Table 5's 405B pipelines are not among the rows: they ran async tensor
parallelism, which the model does not see (and Float8, which it does).
"""

import argparse
import dataclasses
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from gpu_collect import check as check_collected  # noqa: E402
from megatron_gpt import AS_MEGATRON_RAN  # noqa: E402
from torchtitan_llama import as_torchtitan_ran  # noqa: E402

from project.cli.calibrate import BASES  # noqa: E402
from project.config.checks import check_config  # noqa: E402
from project.config.composed import composed_train_config  # noqa: E402
from project.job.job import Job  # noqa: E402
from project.plan.depth import extrapolated_plan  # noqa: E402
from project.plan.memory_plan import MemoryPlan, plan_memory  # noqa: E402
from project.plan.step_time import StepTime, predict_step  # noqa: E402

# torchtitan's H100s: 96 GB HBM2e at 500 W ("between SXM and NVL"), 8 per host on NVLink, 400 Gb/s RDMA per GPU.
GRAND_TETON = ["cluster=h100_96g_500w_8x"]
# torchtitan's model and loss as each page's rows ran them (benchmarks/torchtitan_llama.py): the H100 tables' code
# (its commit 9dec370) normalised op by op in float32, the A100 tables' (April 2024) with a fused kernel.
AS_RUN_ON_H100 = as_torchtitan_ran("rmsnorm")
AS_RUN_ON_A100 = as_torchtitan_ran("fused_rmsnorm")
SEQUENCE = ["data=tokens", "data.vocab_size=128256", "data.seq_length=8192", "trainer.precision=bf16-mixed"]
# benchmarks/gpu.py's cases: one H200, sequence 1024, the models' own vocabularies. Measured while the host read each
# step's flags at once (it waited for the GPU at every step's end: step_checks=each_step, the code then).
OWN = ["cluster=h200_8x", "trainer.devices=1", "data.seq_length=1024", "trainer.precision=bf16-mixed"]
OWN += ["step_checks=each_step"]


@dataclass
class Row:
    source: str  # where torchtitan publishes it
    what: str  # its layout, in its words
    published: float  # tokens/s per GPU
    overrides: list[str]
    note: str = ""
    over_sequence: bool = True  # composed over SEQUENCE (torchtitan's sequence); a collected run's are its own


def own(preset: str, vocab: int, batch: int, compiled: bool) -> list[str]:
    return [f"model={preset}", "data=tokens", "data.vocab_size=64", f"model.net.vocab_size={vocab}"] + [
        f"data.batch_size={batch}",
        f"model.compile={str(compiled).lower()}",
        *OWN,
    ]


# Measured by us on one H200 at 700 W (docs/gpu.md, 2026-11-26 and 27): the rows the efficiencies are fitted on, and
# ``--refit`` the host's speed, host_op_us, where one of them pins it (the host sets its step).
FITTED = [
    Row("docs/gpu.md", "gpt_350m, batch 16 x 1024, eager", 148185, own("gpt_350m", 50304, 16, False)),
    Row("docs/gpu.md", "gpt_350m, batch 16 x 1024, compiled", 180468, own("gpt_350m", 50304, 16, True)),
    Row("docs/gpu.md", "llama_1b, batch 8 x 1024, eager", 51349, own("llama_1b", 128256, 8, False)),
    Row("docs/gpu.md", "llama_1b, batch 8 x 1024, compiled", 61892, own("llama_1b", 128256, 8, True)),
]
# Checks of the host term, fitted on none: gpt_125m's step, which the host sets the pace of compiled (docs/gpu.md).
HOST_CHECKS = [
    Row("docs/gpu.md", "gpt_125m, batch 16 x 1024, eager", 321738, own("gpt_125m", 50304, 16, False)),
    Row("docs/gpu.md", "gpt_125m, batch 16 x 1024, compiled", 301222, own("gpt_125m", 50304, 16, True)),
]
# Float8's own efficiency is fitted, after the three, on the one Float8 run measured: llama_1b compiled at 1.11x
# its bf16 twin's throughput (docs/gpu.md, 2026-11-28), over the bf16 run above.
FITTED_FLOAT8 = [
    Row(
        "docs/gpu.md",
        "llama_1b, batch 8 x 1024, compiled, Float8",
        round(61892 * 1.11),
        [*own("llama_1b", 128256, 8, True), "model.float8.enabled=true"],
    )
]
SELECTIVE = ["model.activation_checkpointing=selective"]  # torchtitan's per-op selective AC
# torchtitan's Llama 2 runs on 64 A100s (the same earlier page): sequence 4096, Llama 2's 32,000-token vocabulary and
# RoPE; the 70B's shape is Llama 3's (grouped keys and values, SwiGLU 28,672 wide), the 13B's is Llama 2's own.
LLAMA_2 = ["data=tokens", "data.vocab_size=32000", "data.seq_length=4096", "trainer.precision=bf16-mixed"]
LLAMA_2 += ["model.net.rope_scaling=null", "model.net.rope_theta=10000.0", "cluster=a100_80g_8x", "strategy=fsdp"]
LLAMA_2 += ["trainer.devices=8", "trainer.num_nodes=8", *AS_RUN_ON_A100]
LLAMA_2_13B = ["model=llama_8b", "model.net.num_layers=40", "model.net.dim=5120", "model.net.num_heads=40"]
LLAMA_2_13B += ["model.net.num_kv_heads=40", "model.net.hidden_dim=13824"]
ROWS = [
    Row(
        "Table 1",
        "8B, FSDP 8, H100, local batch 2, selective AC",
        5762,
        [
            "model=llama_8b",
            "strategy=fsdp",
            "trainer.devices=8",
            "data.batch_size=2",
            *SELECTIVE,
            *GRAND_TETON,
            *AS_RUN_ON_H100,
        ],
    ),
    Row(
        "Table 1",
        "8B, FSDP 8 + torch.compile, H100, local batch 2, selective AC",
        6667,
        ["model=llama_8b", "strategy=fsdp", "trainer.devices=8", "data.batch_size=2", "model.compile=true"]
        + [*SELECTIVE, *GRAND_TETON, *AS_RUN_ON_H100],
    ),
    Row(
        "Table 3",
        "8B, FSDP 128, H100, local batch 2, selective AC",
        5605,
        ["model=llama_8b", "strategy=fsdp", "trainer.devices=8", "trainer.num_nodes=16", "data.batch_size=2"]
        + [*SELECTIVE, *GRAND_TETON, *AS_RUN_ON_H100],
    ),
    Row(
        "Llama 3 on A100 (earlier version)",
        "8B, FSDP 64, A100 80GB, local batch 1, selective op AC",
        2973,
        ["model=llama_8b", "strategy=fsdp", "trainer.devices=8", "trainer.num_nodes=8", "data.batch_size=1"]
        + [*SELECTIVE, "cluster=a100_80g_8x", *AS_RUN_ON_A100],
    ),
    Row(
        "Llama 3 on A100 (earlier version)",
        "70B, FSDP 64, A100 80GB, local batch 1, full AC",
        331,
        ["model=llama_70b", "strategy=fsdp", "trainer.devices=8", "trainer.num_nodes=8", "data.batch_size=1"]
        + ["model.activation_checkpointing=true", "cluster=a100_80g_8x", *AS_RUN_ON_A100],
    ),
    *[
        Row("Llama 2 on A100 (earlier version)", what, published, [*LLAMA_2, *overrides], over_sequence=False)
        for what, published, overrides in [
            ("Llama 2 13B, FSDP 64, A100 80GB, local batch 2, no AC", 2162, [*LLAMA_2_13B, "data.batch_size=2"]),
            (
                "Llama 2 13B, FSDP 64, A100 80GB, local batch 2, selective op AC",
                1904,
                [*LLAMA_2_13B, "data.batch_size=2", *SELECTIVE],
            ),
            (
                "Llama 2 70B, FSDP 64, A100 80GB, local batch 1, selective op AC",
                355,
                ["model=llama_70b", "data.batch_size=1", *SELECTIVE],
            ),
            (
                "Llama 2 70B, FSDP 64, A100 80GB, local batch 2, full AC",
                353,
                ["model=llama_70b", "data.batch_size=2", "model.activation_checkpointing=true"],
            ),
        ]
    ],
    Row(
        "Table 4",
        "70B, FSDP 32 x TP 8, H100, local batch 16, full AC, compile + Float8",
        829,
        ["model=llama_70b", "strategy=fsdp", "strategy.tensor_parallel_size=8", "trainer.devices=8"]
        + ["trainer.num_nodes=32", "data.batch_size=16", "model.activation_checkpointing=true", "model.compile=true"]
        + ["model.float8.enabled=true", *GRAND_TETON, *AS_RUN_ON_H100],
        "async TP not modelled",
    ),
]


def megatron_tokens_per_s(tflops: float, layers: int, hidden: int, seq: int = 2048, vocab: int = 51200) -> float:
    """Tokens/s per GPU of a published Megatron throughput in TFLOP/s per GPU, which Narayanan et al. (2021) count
    as 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs a batch of B sequences: full recomputation's extra forward included."""
    flops_per_token = 96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return tflops * 1e12 / flops_per_token


def megatron_row(
    billions: float, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int, tflops: float
) -> Row:
    """A row of Megatron-LM's weak-scaling table (Narayanan et al., SC'21, Table 1: GPT, sequence 2048, vocabulary
    51,200, mixed precision, full recomputation, DGX A100 80GB nodes with 8 HDR InfiniBand ports) in this project's
    nearest layout, with Megatron's GPT (``megatron_gpt``): without a pipeline, tensor parallelism under FSDP
    (Megatron's data parallelism all-reduced whole gradients, half the bytes of FSDP's two gathers and
    reduce-scatter; either hides behind these rows' compute); with one, interleaved 1F1B (2 stages a rank) over
    micro-batches of one sequence (Table 1 states neither: both assumed); tensor parallelism without sequence
    parallelism, as Megatron's then, but under a pipeline, whose sends sequence parallelism splits as Megatron's
    scatter/gather did."""
    replicas = gpus // (tp * pp)
    local = batch // replicas  # sequences a replica's step
    model = ["model=gpt", f"model.net.num_layers={layers}", f"model.net.dim={hidden}", f"model.net.num_heads={heads}"]
    model += AS_MEGATRON_RAN
    model += ["model.net.vocab_size=51200", "data=tokens", "data.vocab_size=51200", "data.seq_length=2048"]
    model += ["trainer.precision=bf16-mixed", "model.activation_checkpointing=true", "cluster=a100_80g_8x"]
    nodes = [f"trainer.devices={min(gpus, 8)}", f"trainer.num_nodes={max(gpus // 8, 1)}", f"data.batch_size={local}"]
    if pp > 1:
        # Sequence parallelism kept: its stages send each rank's share of the sequence, as Megatron's scatter/gather
        # of the pipeline's sends did (the paper's section 4.1); without it they would send it whole, 8 times that
        layout = ["strategy=pipeline", f"strategy.tensor_parallel_size={tp}", f"strategy.num_stages={2 * pp}"]
        layout += ["strategy.schedule=interleaved_1f1b", "strategy.stages_per_rank=2", f"strategy.microbatches={local}"]
    elif tp > 1:
        # Megatron of 2021 had no sequence parallelism: its ranks all-reduced and ran the norms on the whole sequence
        layout = ["strategy=fsdp", f"strategy.tensor_parallel_size={tp}", "strategy.sequence_parallel=false"]
    else:
        layout = ["strategy=ddp"]
    what = f"GPT {billions}B, TP {tp} x PP {pp} x DP {replicas}, {gpus} A100s, batch {batch}"
    note = f"published {tflops:g} TFLOP/s a GPU, recompute counted"
    return Row(
        "Megatron Table 1",
        what,
        megatron_tokens_per_s(tflops, layers, hidden),
        [*model, *nodes, *layout],
        note,
        over_sequence=False,
    )


MEGATRON = [
    megatron_row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    megatron_row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    megatron_row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    megatron_row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    megatron_row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    megatron_row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    megatron_row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    megatron_row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    megatron_row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    megatron_row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]

# The GPU benchmark's models whose step the host sets the pace of (docs/gpu.md): they fit the host's speed, not the
# efficiencies.
HOST_BOUND_MODELS = {"gpt", "gpt_125m"}


@dataclass
class Collected:
    """A gpu_collect.json's measured cases, as rows: those the efficiencies, Float8's and the host's speed fit."""

    bf16: list[Row]
    float8: list[Row]
    host: list[Row]
    peer: dict[str, Any] | None


def collected(path: Path) -> Collected:
    """The cases ``scripts/gpu_collect.py`` measured (each with a throughput), planned on the GPU's datasheet
    cluster with the run's own overrides but its accelerator (this machine plans for GPUs without one)."""
    report = json.loads(path.read_text())
    problems = check_collected(report)
    if problems:
        raise SystemExit(f"{path}: " + "; ".join(problems))
    gpu = report["machine"]["gpu"] or ""
    cluster = next((base for part, base in BASES if part in gpu), None)
    if cluster is None:
        raise SystemExit(f"{path}: no datasheet cluster is known for the GPU {gpu!r} (conf/cluster)")
    source = f"{path.name} ({gpu}, {report['machine']['date']})"
    rows: dict[str, list[Row]] = {"bf16": [], "float8": [], "host": []}
    for case in report["cases"]:
        if case.get("error") or not case.get("tokens_per_sec"):
            continue
        overrides = [item for item in case["overrides"] if not item.startswith("trainer.accelerator=")]
        row = Row(source, case["case"], case["tokens_per_sec"], [*overrides, f"cluster={cluster}"], over_sequence=False)
        kind = "host" if case["model"] in HOST_BOUND_MODELS else "float8" if case["float8"] else "bf16"
        rows[kind].append(row)
    return Collected(rows["bf16"], rows["float8"], rows["host"], report.get("peer"))


def config(overrides: list[str], over_sequence: bool = True):
    """The config ``python train.py <overrides>`` resolves to, as the plan reads it."""
    cfg = composed_train_config([*(SEQUENCE if over_sequence else []), "data.num_train=100000", *overrides])
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


EFFICIENCIES = ("matmul_efficiency", "attention_efficiency", "bandwidth_efficiency")


@dataclass
class Planned:
    row: Row
    job: Job
    plan: MemoryPlan
    seconds: float  # to simulate

    def step(self, efficiencies: dict[str, Any]) -> StepTime:
        assert self.job.cluster is not None
        return predict_step(self.plan, self.job, dataclasses.replace(self.job.cluster, **efficiencies))

    def error(self, efficiencies: dict[str, Any]) -> float:
        return self.step(efficiencies).tokens_per_device_per_s / self.row.published - 1


def planned(row: Row) -> Planned:
    start = time.perf_counter()
    job = check_config(config(row.overrides, row.over_sequence))
    plan = extrapolated_plan(job) or plan_memory(job, suggest=False)
    return Planned(row, job, plan, time.perf_counter() - start)


def fit(rows: list[Planned], names: tuple[str, ...], fixed: dict[str, float] | None = None) -> dict[str, float]:
    """The efficiencies ``names``, to 0.01, whose largest error over ``rows`` is smallest (with ``fixed`` as they
    are): on a grid of 0.05 from 0.2 to 1, then of 0.01 around the best."""

    def best(grids: list[list[float]]) -> dict[str, float]:
        candidates = [{**(fixed or {}), **dict(zip(names, values))} for values in itertools.product(*grids)]
        return min(candidates, key=lambda efficiencies: max(abs(row.error(efficiencies)) for row in rows))

    coarse = best([[step / 20 for step in range(4, 21)]] * len(names))
    return best([[round(coarse[name] + step / 100, 2) for step in range(-4, 5)] for name in names])


HOST_GRID = [tenth / 10 for tenth in range(10, 1000)]  # host_op_us from 1 to 99.9 us an op


def fit_host(rows: list[Planned], efficiencies: dict[str, Any]) -> float | None:
    """The cluster's ``host_op_us``, to 0.1, whose largest error over ``rows`` is smallest; None where that is an end
    of the grid: the rows do not pin it (a step the device sets moves with the host's speed only by the framework's
    work after its wait; where the device alone is already slower than measured, the least error runs off to the
    fastest host)."""
    best = min(HOST_GRID, key=lambda host: max(abs(row.error({**efficiencies, "host_op_us": host})) for row in rows))
    return None if best in (HOST_GRID[0], HOST_GRID[-1]) else best


def _figure(tokens_per_s: float) -> str:
    """Whole tokens, or 3 significant figures below 100 (a trillion parameters train 20 tokens/s a GPU)."""
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.3g}"


def table(rows: list[Planned], efficiencies: dict[str, Any]) -> None:
    print(
        "| source | run | measured tokens/s/GPU | predicted | error | MFU | exposed comm s | bubble s | host's share | "
        "waiting on the host s | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        step = row.step(efficiencies)
        print(
            f"| {row.row.source} | {row.row.what} | {_figure(row.row.published)} | "
            f"{_figure(step.tokens_per_device_per_s)} | "
            f"{row.error(efficiencies):+.1%} | {step.mfu:.1%} | {step.exposed_communication:.3f} | "
            f"{step.bubble:.3f} | {step.host / step.seconds:.0%} | {step.host_bound:.4f} | {row.row.note} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "rows",
        nargs="?",
        choices=["8b", "own", "megatron"],
        help="8b: our own rows and the Llama 3.1 8B rows only; own: ours only; megatron: ours and Megatron-LM's",
    )
    parser.add_argument(
        "--refit", nargs="?", const="", default=None, metavar="FILE", help="fit again (on FILE: a gpu_collect.json)"
    )
    parser.add_argument("--cpu-host-costs", action="store_true", help="the CPU machine's host costs")
    args = parser.parse_args()
    published = {"8b": [row for row in ROWS if "8B" in row.what], "own": [], "megatron": MEGATRON}.get(args.rows, ROWS)
    refit = args.refit is not None
    measured = collected(Path(args.refit)) if args.refit else None
    bf16, float8, host_bound = (
        (FITTED, FITTED_FLOAT8, HOST_CHECKS) if measured is None else (measured.bf16, measured.float8, measured.host)
    )
    own_rows = [planned(row) for row in bf16]
    float8_rows = [planned(row) for row in float8]
    roofline = OmegaConf.load(REPO / "conf" / "step_time" / "roofline.yaml")
    efficiencies = {name: roofline[name] for name in (*EFFICIENCIES, "float8_matmul_efficiency")}
    if refit and own_rows:
        efficiencies = {**efficiencies, **fit(own_rows, EFFICIENCIES)}
    if refit and float8_rows:
        efficiencies = fit(float8_rows, ("float8_matmul_efficiency",), efficiencies)
    host_checks = [planned(row) for row in host_bound]
    host: float | None = roofline["host_op_us"]
    if args.cpu_host_costs:
        efficiencies = {**efficiencies, "host_costs": None}
        host = fit_host(own_rows + host_checks, efficiencies)
    elif refit and measured is not None and host_checks:
        host = fit_host(host_checks, efficiencies)  # the host-bound cases: the host sets their pace
    elif refit:
        host = fit_host(own_rows, efficiencies)
    if host is None and args.cpu_host_costs:
        raise SystemExit("host_op_us: our rows do not pin it under the CPU machine's host costs (see fit_host)")
    if host is None:
        host = roofline["host_op_us"]
        print(f"host_op_us: the rows it is fitted on do not pin it (the least error at the grid's end); kept at {host}")
    efficiencies = {**efficiencies, "host_op_us": host}
    figures = ", ".join(f"{name} {value:.2f}" for name, value in efficiencies.items() if value is not None)
    rows_named = "On our H200 rows:" if measured is None else f"On {args.refit}:"
    print(rows_named, figures, "(the CPU machine's host costs)" if "host_costs" in efficiencies else "")
    table(own_rows + float8_rows + host_checks, efficiencies)
    print()
    if measured is not None and measured.peer is not None:
        peer = measured.peer
        print(
            f"Peer: {peer['trainer']}, {peer['model']}{' compiled' if peer['compile'] else ''}, "
            f"{peer['batch_size']} x {peer['seq_length']}: {peer['tokens_per_sec']:,.0f} tokens/s, peak "
            + ("n/a" if peer["peak_allocated_mb"] is None else f"{peer['peak_allocated_mb']:,.0f} MiB")
            + "\n"
        )
    rows = []
    for row in published:
        rows.append(planned(row))
        print(f"  ({rows[-1].seconds:.0f} s to simulate {row.what})", file=sys.stderr, flush=True)
    if rows:
        table(rows, efficiencies)


if __name__ == "__main__":
    main()
