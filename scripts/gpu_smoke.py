"""The GPU smoke, ``make gpu-check``'s first part: 3 training steps of every feature combination a user can ask for
on one GPU, each a real ``python train.py``, and a table of each as passed, refused before launch (with the rule
it breaks) or failed (with its first error line).

    python scripts/gpu_smoke.py --out <dir> [--jobs 8] [--only strategy=fsdp compile=compiled ...] [--short] [--cpu]

The features (``FEATURES``): the model (a dense Llama, a mixture of experts, whose experts run as grouped matmuls
in bf16 on a GPU), the strategy (auto, fsdp, tensor_parallel, each on one device), eager or compiled blocks,
activation checkpointing (off, selective, full), bf16 or Float8 matmuls, and full weights, LoRA or QLoRA. Every
combination is checked as ``train.py`` checks it before launch (``check_config``): what it refuses (Float8 with
LoRA, say) is a row with the rule's message, not a run. The others train, ``--jobs`` at a time, each in a fresh
process (so each compiles its own blocks; a shared process would reuse, or past its recompile limit silently stop
compiling, another's). ``--short``: each setting once, the others at their first (``short_list``). Writes
``gpu_smoke.md`` and ``gpu_smoke.json`` to ``--out``; exits 1 if a run failed.
``--cpu`` runs the same on the CPU (Float8 emulated by torchao, no grouped matmuls): the check of the script itself.
"""

import argparse
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Sizes every feature takes: widths in multiples of 16 (Float8's matmuls), weights in NF4's blocks of 64 (QLoRA).
DENSE = ["model=llama", "model.net.dim=128", "model.net.num_heads=4", "model.net.num_kv_heads=2"]
DENSE += ["model.net.head_dim=64", "model.net.hidden_dim=256", "model.net.num_layers=2"]
MIXTURE = ["model=moe", "model.net.dim=128", "model.net.num_heads=4", "model.net.num_kv_heads=2"]
MIXTURE += ["model.net.hidden_dim=256", "model.net.expert_hidden_dim=128", "model.net.num_layers=2"]
MIXTURE += ["model.net.first_dense_layers=1", "model.net.experts_per_token=2"]
LORA = ["model.lora.rank=16", "model.lora.alpha=32"]

# Each feature: its settings, each named, with the overrides that ask for it.
FEATURES: dict[str, dict[str, list[str]]] = {
    "model": {"dense": DENSE, "mixture": MIXTURE},
    "strategy": {name: [f"strategy={name}"] for name in ("auto", "fsdp", "tensor_parallel")},
    "compile": {"eager": ["model.compile=false"], "compiled": ["model.compile=true"]},
    "checkpointing": {
        name: [f"model.activation_checkpointing={value}"]
        for name, value in (("off", "false"), ("selective", "selective"), ("full", "true"))
    },
    "matmuls": {"bf16": [], "float8": ["model.float8.enabled=true", "model.float8.small_layers=true"]},
    "weights": {"full": [], "lora": LORA, "qlora": [*LORA, "model.lora.quantize_base=true"]},
}
# What every run shares: 3 steps of a small language on one device, no logger, no checkpoints.
COMMON = [
    "data=tokens",
    "data.vocab_size=256",
    "data.seq_length=64",
    "data.batch_size=8",
    "data.num_train=64",
    "data.num_val=16",
    "trainer.devices=1",
    "trainer.precision=bf16-mixed",
    "trainer.max_steps=3",
    "trainer.max_epochs=1",
    "logger=none",
    "callbacks.model_checkpoint=null",
    "+trainer.enable_checkpointing=false",  # else Lightning adds a checkpoint callback of its own
    "print_config=false",
]
# An exception as a traceback's last line names it (``torch._dynamo.exc.BackendCompilerFailed: ...``), or our own
# refusal (``Config error: ...``).
ERROR_LINE = re.compile(r"^\s*(([A-Za-z_]\w*\.)*[A-Z]\w*(Error|Exception|Failed|Failure|Interrupt)\b|Config error:)")


def combinations(only: dict[str, str]) -> Iterator[dict[str, str]]:
    """Every combination of the features' settings, in ``FEATURES``' order; ``only`` fixes some features."""
    settings = [[only[name]] if name in only else list(options) for name, options in FEATURES.items()]
    for chosen in itertools.product(*settings):
        yield dict(zip(FEATURES, chosen))


def short_list() -> Iterator[dict[str, str]]:
    """The first setting of every feature, then each other setting with the rest at their first: each setting runs
    once (10 combinations), for a lease too short for every combination (``make gpu-collect``)."""
    base = {name: next(iter(options)) for name, options in FEATURES.items()}
    yield base
    for name, options in FEATURES.items():
        for setting in list(options)[1:]:
            yield {**base, name: setting}


def overrides(combination: dict[str, str], accelerator: str) -> list[str]:
    chosen = [override for name, setting in combination.items() for override in FEATURES[name][setting]]
    return [*COMMON, f"trainer.accelerator={accelerator}", *chosen]


def refusal(args: list[str]) -> str | None:
    """What ``train.py`` would refuse ``args`` with before launch (its ``ConfigError``'s one line), or None."""
    from project.config.checks import check_config
    from project.config.composed import composed_train_config
    from project.launch.resolution import resolved_config
    from project.options.errors import ConfigError

    try:
        check_config(resolved_config(composed_train_config(args)))  # as train.py checks it: resolved, then checked
    except ConfigError as error:
        return str(error).splitlines()[0]
    return None


def first_error_line(output: str) -> str:
    """The line of a failed run's output that names its error: the last exception line (the one raised, below
    its causes' tracebacks), else the last line it printed."""
    errors = [line.strip() for line in output.splitlines() if ERROR_LINE.match(line)]
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return (errors or lines or ["(no output)"])[-1][:300]


def train(args: list[str], run_dir: Path, timeout: int) -> dict[str, Any]:
    """One ``python train.py`` of ``args`` in ``run_dir``: passed, or failed with its first error line."""
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier smoke's run there: this one starts afresh
    run_dir.mkdir(parents=True)
    command = [sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"outcome": "failed", "seconds": time.monotonic() - start, "message": f"no end within {timeout} s"}
    output = done.stdout + done.stderr
    (run_dir / "output.log").write_text(output)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        return {"outcome": "failed", "seconds": seconds, "message": first_error_line(output)}
    loss = json.loads((run_dir / "result.json").read_text())["final"].get("train/loss")
    if loss is None or not math.isfinite(loss):  # a run that ends well must have trained
        return {"outcome": "failed", "seconds": seconds, "message": f"ended without a finite train/loss ({loss})"}
    return {"outcome": "passed", "seconds": seconds, "message": "", "train_loss": loss}


def markdown(rows: list[dict[str, Any]], machine: str, seconds: float) -> str:
    counts = {outcome: sum(row["outcome"] == outcome for row in rows) for outcome in ("passed", "refused", "failed")}
    lines = [
        f"GPU smoke on {machine}: {len(rows)} combinations, "
        + ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
        + f", in {seconds:.0f} s (`python scripts/gpu_smoke.py`).",
        "",
        f"| {' | '.join(FEATURES)} | outcome | s | first error line, or the rule that refuses it |",
        "|" + "---|" * (len(FEATURES) + 3),
    ]
    for row in rows:
        settings = " | ".join(row["combination"][name] for name in FEATURES)
        seconds_text = f"{row['seconds']:.0f}" if row["outcome"] != "refused" else ""
        lines.append(f"| {settings} | {row['outcome']} | {seconds_text} | {row['message'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=8, help="runs at once (one GPU holds many of these small runs)")
    parser.add_argument("--only", nargs="*", default=[], help="feature=setting pairs that fix features")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a run may take")
    parser.add_argument("--short", action="store_true", help="each setting once, the others at their first")
    parser.add_argument("--cpu", action="store_true", help="on the CPU: the check of this script without a GPU")
    args = parser.parse_args()
    if args.short and args.only:
        parser.error("--short and --only: choose one")
    only = dict(pair.split("=", 1) for pair in args.only)
    for name, setting in only.items():
        if setting not in FEATURES.get(name, {}):
            parser.error(f"--only {name}={setting}: the features are {json.dumps(list(FEATURES))} ({FEATURES})")
    import torch

    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: run it on the GPU box, or with --cpu to check the script here")
    accelerator = "cpu" if args.cpu else "gpu"
    machine = "CPU" if args.cpu else f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    sys.path.insert(0, str(REPO))
    start = time.monotonic()
    rows = []
    for combination in short_list() if args.short else combinations(only):
        run_args = overrides(combination, accelerator)
        reason = refusal(run_args)
        row = {"combination": combination, "overrides": run_args}
        rows.append({**row, "outcome": "refused", "seconds": 0.0, "message": reason} if reason else row)
    to_run = [row for row in rows if "outcome" not in row]
    print(f"{len(rows)} combinations, {len(rows) - len(to_run)} refused before launch; running {len(to_run)}")
    with ThreadPoolExecutor(args.jobs) as pool:
        names = ["-".join(row["combination"].values()) for row in to_run]
        results = pool.map(
            lambda row, name: train(row["overrides"], args.out / "runs" / name, args.timeout), to_run, names
        )
        for row, result in zip(to_run, results):
            row.update(result)
            print(f"{'-'.join(row['combination'].values())}: {row['outcome']} {row['message']}", flush=True)
    text = markdown(rows, machine, time.monotonic() - start)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_smoke.md").write_text(text)
    (args.out / "gpu_smoke.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    print(text)
    sys.exit(1 if any(row["outcome"] == "failed" for row in rows) else 0)


if __name__ == "__main__":
    main()
