"""The step-time model against torchtitan's published throughput (docs/performance.md of pytorch/torchtitan, at
its commit 820504e of 2025-06-13, and the A100 tables of its earlier version): the figures of docs/step-time.md.

    python benchmarks/step_time.py          # every row, about 5 minutes on 2 CPU cores
    python benchmarks/step_time.py 8b       # the Llama 3.1 8B rows only, about 2 minutes

Each row's layout is planned as ``plan=search`` plans it (``extrapolated_plan``: the FLOPs and collective bytes
the step time reads are exactly the whole simulation's), and its step predicted on the row's hardware
(``predict_step``). The compute efficiency is calibrated once, on the first row (FSDP, Llama 3.1 8B, 8 H100): the
value that predicts its published 5,762 tokens/s per GPU; every other row uses it. Table 5's 405B pipelines are
not among the rows: 32 micro-batches through 126 blocks take this machine's simulation about 15 minutes a row.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from project.config.checks import check_config  # noqa: E402
from project.config.resolvers import register_resolvers  # noqa: E402
from project.plan.depth import extrapolated_plan  # noqa: E402
from project.plan.memory_plan import plan_memory  # noqa: E402
from project.plan.step_time import predict_step  # noqa: E402

# torchtitan's H100s: 96 GB HBM2e at 500 W ("between SXM and NVL"), 8 per host on NVLink, 400 Gb/s RDMA per GPU.
GRAND_TETON = ["cluster=h100_sxm_8x", "cluster.memory_gb=96"]
SEQUENCE = ["data=tokens", "data.vocab_size=128256", "data.seq_length=8192", "trainer.precision=bf16-mixed"]


@dataclass
class Row:
    source: str  # where torchtitan publishes it
    what: str  # its layout, in its words
    published: float  # tokens/s per GPU
    overrides: list[str]
    note: str = ""


ROWS = [
    Row(
        "Table 1",
        "8B, FSDP 8, H100, local batch 2, selective AC",
        5762,
        ["model=llama_8b", "strategy=fsdp", "trainer.devices=8", "data.batch_size=2", *GRAND_TETON],
        "calibration row",
    ),
    Row(
        "Table 1",
        "8B, FSDP 8 + torch.compile, H100, local batch 2, selective AC",
        6667,
        ["model=llama_8b", "strategy=fsdp", "trainer.devices=8", "data.batch_size=2", *GRAND_TETON],
        "compile not modelled: the same prediction as FSDP",
    ),
    Row(
        "Table 3",
        "8B, FSDP 128, H100, local batch 2, selective AC",
        5605,
        ["model=llama_8b", "strategy=fsdp", "trainer.devices=8", "trainer.num_nodes=16", "data.batch_size=2"]
        + GRAND_TETON,
    ),
    Row(
        "Llama 3 on A100 (earlier version)",
        "8B, FSDP 64, A100 80GB, local batch 1, selective op AC",
        2973,
        ["model=llama_8b", "strategy=fsdp", "trainer.devices=8", "trainer.num_nodes=8", "data.batch_size=1"]
        + ["cluster=a100_80g_8x"],
    ),
    Row(
        "Llama 3 on A100 (earlier version)",
        "70B, FSDP 64, A100 80GB, local batch 1, full AC",
        331,
        ["model=llama_70b", "strategy=fsdp", "trainer.devices=8", "trainer.num_nodes=8", "data.batch_size=1"]
        + ["model.activation_checkpointing=true", "cluster=a100_80g_8x"],
    ),
    Row(
        "Table 4",
        "70B, FSDP 32 x TP 8, H100, local batch 16, full AC, compile + Float8",
        829,
        ["model=llama_70b", "strategy=fsdp", "strategy.tensor_parallel_size=8", "trainer.devices=8"]
        + ["trainer.num_nodes=32", "data.batch_size=16", "model.activation_checkpointing=true", *GRAND_TETON],
        "Float8 and compile not modelled (bf16)",
    ),
]


def config(overrides: list[str]):
    """The config ``python train.py <overrides>`` resolves to, as the plan reads it."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*SEQUENCE, "data.num_train=100000", *overrides], return_hydra_config=True)
    cfg.hydra.runtime.output_dir = "/tmp/unused-job-dir"
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))


def predict(row: Row, efficiency: float) -> tuple[float, float, float, float]:
    """Tokens/s per GPU, exposed communication and bubble seconds, and the seconds the simulation took."""
    start = time.perf_counter()
    job = check_config(config([*row.overrides, f"cluster.compute_efficiency={efficiency}"]))
    assert job.cluster is not None
    plan = extrapolated_plan(job) or plan_memory(job, suggest=False)
    step = predict_step(plan, job, job.cluster)
    return step.tokens_per_device_per_s, step.exposed_communication, step.bubble, time.perf_counter() - start


def main() -> None:
    register_resolvers()
    rows = [row for row in ROWS if "8B" in row.what] if sys.argv[1:] == ["8b"] else ROWS
    at_peak, exposed, bubble, _ = predict(ROWS[0], 1.0)
    assert exposed == bubble == 0, "the calibration row's step must be all compute: tokens/s in proportion to it"
    efficiency = ROWS[0].published / at_peak
    print(f"compute_efficiency calibrated on {ROWS[0].source}, {ROWS[0].what}: {efficiency:.4f}")
    print("| source | layout | published tokens/s/GPU | predicted | error | exposed comm s | bubble s | note |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        tokens, exposed, bubble, seconds = predict(row, efficiency)
        error = (tokens - row.published) / row.published
        print(
            f"| {row.source} | {row.what} | {row.published:,.0f} | {tokens:,.0f} | {error:+.1%} | {exposed:.3f} | "
            f"{bubble:.3f} | {row.note} |",
            flush=True,
        )
        print(f"  ({seconds:.0f} s to simulate)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
