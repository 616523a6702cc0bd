"""Memory per device of each way to lay a model out over devices, and the losses of options the suite does not run
under tensor parallelism: the figures of docs/tensor-parallel.md.

    python benchmarks/layouts.py            # every table, about 12 minutes on 2 CPU cores
    python benchmarks/layouts.py measured   # real runs of a small GPT in every layout
    python benchmarks/layouts.py scale      # plans of Llama 3.1 8B on 32 simulated GPUs
    python benchmarks/layouts.py options    # options the suite does not run under tensor parallelism, vs one device

Measured: each run trains a few steps with the same global batch, tracks every tensor of its first two training
steps (``callbacks.memory.tracked_steps=2``, on real tensors and real gloo process groups) and logs its model state
per device (the fullest device's) next to its memory plan. The first epoch's training loss shows the layouts train
the same model.
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import TINY_GPT  # noqa: E402  (the tests' tiny GPT)
from memory_plan import plan  # noqa: E402
from readme_figures import QUIET, epochs, main, run, table  # noqa: E402

# A GPT of 3.4 M parameters (4 blocks of width 256, 8 heads, a 512-token vocabulary), sequences of 128 tokens.
MODEL = [
    "model=gpt",
    "data=tokens",
    "data.vocab_size=512",
    "data.seq_length=128",
    "data.num_train=2048",
    "data.num_val=256",
    "model.net.dim=256",
    "model.net.num_layers=4",
    "model.net.num_heads=8",
]
SHORT = [
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=4",
    "+trainer.limit_val_batches=2",
    "trainer.num_sanity_val_steps=0",
    "callbacks.memory.tracked_steps=2",
]
GLOBAL_BATCH = 16
# layout -> (overrides, devices, data-parallel replicas: the global batch's divisor)
LAYOUTS = {
    "auto": ([], 1, 1),
    "ddp": (["strategy=ddp", "trainer.devices=4"], 4, 4),
    "fsdp": (["strategy=fsdp", "trainer.devices=4"], 4, 4),
    "tensor_parallel": (["strategy=tensor_parallel", "trainer.devices=4"], 4, 1),
    "fsdp 2 x tp 2": (["strategy=fsdp", "trainer.devices=4", "strategy.tensor_parallel_size=2"], 4, 2),
    "pipeline 4 stages": (["strategy=pipeline", "trainer.devices=4"], 4, 1),
    "pipeline 2 x tp 2": (
        ["strategy=pipeline", "trainer.devices=4", "strategy.num_stages=2", "strategy.tensor_parallel_size=2"],
        4,
        1,
    ),
    "pipeline 2 x fsdp 2 x tp 2": (
        ["strategy=pipeline", "trainer.devices=8", "strategy.num_stages=2", "strategy.tensor_parallel_size=2"],
        8,
        2,
    ),
}


def measured(tmp: Path) -> str:
    rows, whole = [], None
    for name, (overrides, devices, replicas) in LAYOUTS.items():
        job_dir = tmp / name.replace(" ", "-")
        run([*MODEL, *overrides, *SHORT, f"data.batch_size={GLOBAL_BATCH // replicas}"], job_dir)
        last = epochs(job_dir)[-1]
        state = last["memory/model_state_mb"]
        whole = whole or state
        rows.append(
            [
                f"`{name}`",
                str(devices),
                f"{state:.1f}",
                f"{state / whole:.3f}",
                f"{last['memory/tracked_peak_mb']:.1f}",
                f"{last['memory/planned_peak_mb']:.1f}",
                f"{last['train/loss']:.5f}",
            ]
        )
    return table(
        [
            "layout",
            "devices",
            "model state MiB per device",
            "of one device's",
            "peak MiB (measured)",
            "peak MiB (planned)",
            "train/loss",
        ],
        rows,
    )


# Llama 3.1 8B, 4096-token sequences, bf16-mixed, 32 sequences per step, on 4 nodes of 8 GPUs of 80 GiB.
LARGE = [
    "model=llama_8b",
    "data=tokens",
    "data.vocab_size=128256",
    "data.seq_length=4096",
    "data.num_train=100000",
    "data.num_val=2048",
    "trainer.devices=8",
    "trainer.num_nodes=4",
    "trainer.precision=bf16-mixed",
    "memory_plan.device_memory_gb=80",
    "memory_plan.if_over=warn",
    "logger=none",
]
PLANNED = {
    "fsdp (32 ranks)": ["strategy=fsdp", "data.batch_size=1"],
    "fsdp 4 x tp 8": ["strategy=fsdp", "strategy.tensor_parallel_size=8", "data.batch_size=8"],
    "pipeline 2 x fsdp 2 x tp 8": [
        "strategy=pipeline",
        "strategy.num_stages=2",
        "strategy.tensor_parallel_size=8",
        "data.batch_size=16",
        "strategy.microbatches=4",
    ],
}


def at_scale(tmp: Path) -> str:
    """``plan=true`` of each layout: the fullest device's row (with activation checkpointing both ways)."""
    rows = []
    for name, overrides in PLANNED.items():
        output, _ = plan([*LARGE, *overrides], tmp)
        devices = [
            re.findall(r"\d+(?:\.\d+)? [KMG]iB", line) for line in output.splitlines() if line.startswith("rank ")
        ]
        rows.append([name, *max(devices, key=lambda sizes: _gib(sizes[5]))])
    return table(
        [
            "layout",
            "params",
            "grads",
            "optimizer",
            "activations",
            "comm buffers",
            "peak",
            "activations (AC on)",
            "peak (AC on)",
        ],
        rows,
    )


def _gib(size: str) -> float:
    value, unit = size.split()
    return float(value) * {"KiB": 2**-20, "MiB": 2**-10, "GiB": 1}[unit]


# The tests' tiny GPT (2 blocks of width 32, 2 heads, 3 epochs), with 32 sequences of 16 tokens per step; its quiet
# console options are run()'s own.
TINY = [item for item in TINY_GPT if item not in QUIET]
# option -> (what it adds to one device's run and to the layout's, the layout, its data-parallel replicas)
OPTIONS = {
    "tied embedding, tensor_parallel 2": (
        ["model.net.tie_weights=true"],
        ["strategy=tensor_parallel", "trainer.devices=2"],
        1,
    ),
    "model.compile, tensor_parallel 2": (["model.compile=true"], ["strategy=tensor_parallel", "trainer.devices=2"], 1),
    "strategy.activation_checkpointing, fsdp 2 x tp 2": (
        [],
        [
            "strategy=fsdp",
            "trainer.devices=4",
            "strategy.tensor_parallel_size=2",
            "strategy.activation_checkpointing=true",
        ],
        2,
    ),
    "model.activation_checkpointing, pipeline 2 x tp 2": (
        ["model.activation_checkpointing=true"],
        ["strategy=pipeline", "trainer.devices=4", "strategy.num_stages=2", "strategy.tensor_parallel_size=2"],
        1,
    ),
}


def options(tmp: Path) -> str:
    """Each option under its layout against one device with the same option: the largest relative difference of
    the per-epoch train/loss and val/loss."""
    rows = []
    for number, (name, (option, layout, replicas)) in enumerate(OPTIONS.items()):
        logged = []
        for overrides, batch in (([], 32), (layout, 32 // replicas)):
            job_dir = tmp / f"option-{number}-{len(logged)}"
            run([*TINY, *option, *overrides, f"data.batch_size={batch}"], job_dir)
            logged.append([(e["train/loss"], e["val/loss"]) for e in epochs(job_dir)])
        one_device, split = (sum(values, ()) for values in logged)
        difference = max(abs(a - b) / abs(b) for a, b in zip(split, one_device))
        rows.append([name, f"{one_device[-2]:.5f}", f"{split[-2]:.5f}", f"{difference:.1e}"])
    return table(
        [
            "option, layout",
            "last train/loss, one device",
            "last train/loss, layout",
            "largest relative difference (train and val loss, every epoch)",
        ],
        rows,
    )


if __name__ == "__main__":
    main({"measured": measured, "scale": at_scale, "options": options})
