"""The memory plan against what runs measure, and plans of a large model on a simulated cluster: the figures of
README.md's "Will it fit?" section.

    python benchmarks/memory_plan.py            # both tables, about 3 minutes on 2 CPU cores
    python benchmarks/memory_plan.py measured   # predicted against measured only
    python benchmarks/memory_plan.py scale      # the 1024-rank plans only

Measured: each run tracks every tensor of its first two training steps (``callbacks.memory.tracked_steps=2``,
PyTorch's MemTracker on real tensors and real gloo process groups) and logs the peak next to the plan's.
"""

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from readme_figures import REPO, epochs, run, table  # noqa: E402

GPT = ["model=gpt", "data=tokens"]
STRATEGIES = {"auto": [], "ddp": ["strategy=ddp", "trainer.devices=2"], "fsdp": ["strategy=fsdp", "trainer.devices=2"],
              "pipeline": ["strategy=pipeline", "trainer.devices=2"]}
SHORT = ["trainer.max_epochs=1", "+trainer.limit_train_batches=2", "+trainer.limit_val_batches=1",
         "trainer.num_sanity_val_steps=0", "callbacks.memory.tracked_steps=2"]
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
            rows.append([model, strategy, f"{last['memory/model_state_mb']:.3f}", "yes" if same else "NO",
                         f"{planned:.2f}", f"{tracked:.2f}", f"{(planned - tracked) / tracked:+.1%}"])
    return table(["model", "strategy", "model state MiB (measured)", "plan equal, byte for byte",
                  "planned peak MiB", "measured peak MiB", "plan vs measured"], rows)


LARGE = ["model=gpt_1_3b", "data=tokens", "data.vocab_size=50257", "data.seq_length=1024", "data.batch_size=8",
         "data.num_train=100000", "data.num_val=2048", "trainer.devices=8", "trainer.num_nodes=128",
         "trainer.precision=bf16-mixed", "memory_plan.device_memory_gb=80"]
LAYOUTS = {"ddp": ["strategy=ddp"], "fsdp": ["strategy=fsdp"],
           "pipeline (8 stages x 128 data-parallel)": ["strategy=pipeline", "strategy.num_stages=8",
                                                       "strategy.microbatches=8", "model.net.tie_weights=false"]}


def at_scale(tmp: Path) -> str:
    """``plan=true`` for GPT-3 XL on 1024 simulated ranks: each layout's plan (with activation checkpointing both
    ways, and the search for a change that fits), its wall time, and the fsdp plan as printed."""
    rows, example = [], ""
    for name, overrides in LAYOUTS.items():
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "train.py", "plan=true", *LARGE, *overrides,
                                 f"hydra.run.dir={tmp / 'plan'}"], cwd=REPO, check=True, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        simulated = float(re.search(r"simulated in ([\d.]+) s", result.stdout).group(1))
        verdict = re.search(r"Peak (.*) per device (.*?) in", result.stdout)
        rows.append([name, f"{simulated:.1f}", f"{seconds:.1f}", verdict.group(1), verdict.group(2)])
        if name == "fsdp":
            example = result.stdout.strip()
    return table(["layout", "plan s (simulation)", "plan=true s (whole command)", "peak per device", "80 GiB"],
                 rows) + "\n\n```\n" + example + "\n```"


if __name__ == "__main__":
    wanted = sys.argv[1:] or ["measured", "scale"]
    with tempfile.TemporaryDirectory() as tmp:
        if "measured" in wanted:
            print(measured(Path(tmp)), "\n")
        if "scale" in wanted:
            print(at_scale(Path(tmp)))
