"""The memory plan against what runs measure, and plans of a large model on a simulated cluster: the figures of
docs/memory-plan.md.

    python benchmarks/memory_plan.py            # both tables, about 3 minutes on 2 CPU cores
    python benchmarks/memory_plan.py measured   # predicted against measured only
    python benchmarks/memory_plan.py scale      # the 1024-rank plans only
    python benchmarks/memory_plan.py gpu        # the GPU test's runs planned again, against their H200 peaks
    python benchmarks/memory_plan.py compiled   # the GPU benchmark's runs, compiled and eager, against theirs

Measured: each run tracks every tensor of its first two training steps (``callbacks.memory.tracked_steps=2``,
PyTorch's MemTracker on real tensors and real gloo process groups) and logs the peak next to the plan's.
"""

import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.planned_runs import planned_run  # noqa: E402
from readme_figures import REPO, epochs, main, run, table  # noqa: E402

GPT = ["model=gpt", "data=tokens"]
STRATEGIES = {
    "auto": [],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "fsdp": ["strategy=fsdp", "trainer.devices=2"],
    "pipeline": ["strategy=pipeline", "trainer.devices=2"],
}
SHORT = [
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=2",
    "+trainer.limit_val_batches=1",
    "trainer.num_sanity_val_steps=0",
    "callbacks.memory.tracked_steps=2",
]
MODEL_STATE = ["params", "grads", "optimizer"]


def measured(tmp: Path) -> str:
    rows = []
    for model, model_overrides in (("mlp", []), ("gpt", GPT)):
        for strategy, strategy_overrides in STRATEGIES.items():
            job_dir = tmp / f"{model}-{strategy}"
            run([*model_overrides, *strategy_overrides, *SHORT], job_dir)
            last = epochs(job_dir)[-1]
            same = all(last[f"memory/{part}_mb"] == last[f"memory/planned_{part}_mb"] for part in MODEL_STATE)
            planned, tracked = last["memory/planned_peak_mb"], last["memory/tracked_peak_mb"]
            rows.append(
                [
                    model,
                    strategy,
                    f"{last['memory/model_state_mb']:.3f}",
                    "yes" if same else "NO",
                    f"{planned:.2f}",
                    f"{tracked:.2f}",
                    f"{(planned - tracked) / tracked:+.1%}",
                ]
            )
    return table(
        [
            "model",
            "strategy",
            "model state MiB (measured)",
            "plan equal, byte for byte",
            "planned peak MiB",
            "measured peak MiB",
            "plan vs measured",
        ],
        rows,
    )


LARGE = [
    "model=gpt_1_3b",
    "data=tokens",
    "data.vocab_size=50257",
    "data.seq_length=1024",
    "data.batch_size=8",
    "data.num_train=100000",
    "data.num_val=2048",
    "trainer.devices=8",
    "trainer.num_nodes=128",
    "trainer.precision=bf16-mixed",
    "memory_plan.device_memory_gb=80",
]
ONE_NODE = ["trainer.num_nodes=1", "model.net.tie_weights=false"]
LAYOUTS = {
    "auto (1 device)": ["trainer.devices=1", "trainer.num_nodes=1"],
    "model_parallel (8 stages, 1 node)": ["strategy=model_parallel", *ONE_NODE],
    "ddp (1024 ranks)": ["strategy=ddp"],
    "fsdp (1024 ranks)": ["strategy=fsdp"],
    "pipeline (8 stages x 128 data-parallel)": [
        "strategy=pipeline",
        "strategy.num_stages=8",
        "strategy.microbatches=8",
        "model.net.tie_weights=false",
    ],
    "fsdp (1024 ranks), model=llama_8b, sequence 2048, 2 per device": [
        "strategy=fsdp",
        "model=llama_8b",
        "data.vocab_size=128256",
        "data.seq_length=2048",
        "data.batch_size=2",
    ],
}
# Llama 3.1 8B under DDP on one node of 80 GiB GPUs: refused, with the change that fits.
REFUSED = [
    "model=llama_8b",
    "data=tokens",
    "data.vocab_size=128256",
    "data.seq_length=2048",
    "data.batch_size=2",
    "data.num_train=100000",
    "trainer.devices=8",
    "trainer.precision=bf16-mixed",
    "strategy=ddp",
    "memory_plan.device_memory_gb=80",
]


def plan(overrides: list[str], tmp: Path) -> tuple[str, float]:
    """``python train.py plan=true <overrides>``: its output and wall time."""
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "train.py", "plan=true", *overrides, f"hydra.run.dir={tmp / 'plan'}"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    )
    return result.stdout.strip(), time.perf_counter() - start


def at_scale(tmp: Path) -> str:
    """``plan=true`` for GPT-3 XL (and Llama 3.1 8B) up to 1024 simulated ranks: each layout's plan (with
    activation checkpointing both ways), its wall time, and GPT-3 XL's fsdp plan as printed; then Llama 3.1 8B
    refused under DDP on one node."""
    rows, example = [], ""
    for name, overrides in LAYOUTS.items():
        output, seconds = plan([*LARGE, *overrides], tmp)
        simulated = float(re.search(r"simulated in ([\d.]+) s", output).group(1))
        verdict = re.search(r"Peak (.*) per device (.*?) in", output)
        rows.append([name, f"{simulated:.1f}", f"{seconds:.1f}", verdict.group(1), verdict.group(2)])
        if name == "fsdp (1024 ranks)":
            example = output
    refused, seconds = plan(REFUSED, tmp)
    return (
        table(["layout", "plan s (simulation)", "plan=true s (whole command)", "peak per device", "80 GiB"], rows)
        + "\n\n```\n"
        + example
        + "\n```\n\n"
        + f"Refused ({seconds:.0f} s):\n\n```\n"
        + refused
        + "\n```"
    )


# max_memory_allocated of the GPU memory-plan test's runs (docs/gpu.md, 2026-11-26: one H200, torch 2.11), MiB.
H200_PEAKS = {
    ("gpt_125m", "auto", "false"): 8641,
    ("gpt_125m", "auto", "true"): 5821,
    ("gpt_125m", "fsdp", "false"): 8382,
    ("gpt_125m", "fsdp", "true"): 5606,
    ("gpt_350m", "auto", "false"): 17042,
    ("gpt_350m", "auto", "true"): 9540,
    ("gpt_350m", "fsdp", "false"): 16368,
    ("gpt_350m", "fsdp", "true"): 9057,
    ("llama_1b", "auto", "false"): 32394,
    ("llama_1b", "auto", "true"): 23991,
    ("llama_1b", "fsdp", "false"): 28739,
    ("llama_1b", "fsdp", "true"): 23217,
}


def against_gpu(tmp: Path) -> str:
    """The GPU test's runs planned here for an H200 (``cluster=h200_8x``: CUDA's kernels simulated), against the
    peaks those runs measured on one."""
    rows = []
    for (model, strategy, checkpointing), measured_mib in H200_PEAKS.items():
        output, _ = plan([*planned_run(model, strategy, checkpointing), "cluster=h200_8x"], tmp)
        planned_mib = float(re.search(r"Peak ([\d.]+) GiB per device", output).group(1)) * 1024
        error = (planned_mib - measured_mib) / measured_mib
        on = "on" if checkpointing == "true" else "off"
        rows.append([f"{model}, {strategy}", on, f"{planned_mib:,.0f}", f"{measured_mib:,}", f"{error:+.1%}"])
    return table(["model, strategy", "checkpointing", "planned MiB", "H200 max_memory_allocated MiB", "error"], rows)


# The GPU benchmark's cases (benchmarks/gpu.py; docs/gpu.md, 2026-11-26: one H200, torch 2.11, sequence 1024,
# bf16-mixed): model, vocabulary, batch -> peak allocated MiB (max_memory_allocated) eager and compiled. They ran with
# the loss eager (model.compile compiles it since 2026-11-28), which the plan keeps eager in memory either way.
BENCHMARK_PEAKS = {
    ("gpt_125m", 50304, 16): (15459, 14593),
    ("gpt_350m", 50304, 16): (28149, 25845),
    ("llama_1b", 128256, 8): (43498, 39394),
}


def against_gpu_benchmark(tmp: Path) -> str:
    """The GPU benchmark's runs planned here for an H200, eager and compiled, against their measured peaks."""
    rows = []
    for (model, vocab, batch), peaks in BENCHMARK_PEAKS.items():
        for compiled, measured_mib in zip([False, True], peaks, strict=True):
            overrides = [f"model={model}", "data=tokens", "data.vocab_size=64", f"model.net.vocab_size={vocab}"]
            overrides += ["data.seq_length=1024", f"data.batch_size={batch}", f"model.compile={str(compiled).lower()}"]
            overrides += ["trainer.precision=bf16-mixed", "cluster=h200_8x", "memory_plan.if_over=warn"]
            output, _ = plan(overrides, tmp)
            planned_mib = float(re.search(r"Peak ([\d.]+) GiB per device", output).group(1)) * 1024
            error = (planned_mib - measured_mib) / measured_mib
            name = f"{model}{', compiled' if compiled else ''}, batch {batch}"
            rows.append([name, f"{planned_mib:,.0f}", f"{measured_mib:,}", f"{error:+.1%}"])
    return table(["run", "planned MiB", "H200 max_memory_allocated MiB", "error"], rows)


if __name__ == "__main__":
    main({"measured": measured, "scale": at_scale, "gpu": against_gpu, "compiled": against_gpu_benchmark})
