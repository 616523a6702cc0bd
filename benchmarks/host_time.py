"""The step-time model's host term against this CPU's own steps: ``python benchmarks/host_time.py [--cluster NAME]``.

For each case, ``python train.py plan=true cluster=<cluster>`` predicts a training step (``cpu_2core``: this
machine's CPU, measured by ``python -m project.cli.calibrate --cpu``), and ``python train.py`` trains it for 4
epochs: its step is the samples a device trains per step over ``perf/samples_per_sec_per_device`` (training time
only, no validation), the median over the epochs after the first. Each case runs ``--repeats`` times, in rounds
over the cases; the error is given against the fastest run (the machine least disturbed by others: what the model
predicts) and the median one. Threads pinned as ``benchmarks/overhead.py`` pins them (the cores split between the
case's processes). No case is fitted: the framework's own cost per step (``FRAMEWORK_STEP_OPS``) was measured on
the default MLP's step (``benchmarks/step_breakdown.py``), the host's op by ``calibrate --cpu`` on a narrower net.
"""

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The tiny GPT at 2 sequences of 16 tokens: its step is nearly all host time.
SMALL_GPT = ["model=gpt", "data=tokens", "data.batch_size=2", "data.seq_length=16", "data.num_train=512"]
SMALL_GPT += ["data.num_val=64"]
CASES = {
    "tiny GPT, 2 x 16, eager": SMALL_GPT,
    "tiny GPT, 2 x 16, compiled": [*SMALL_GPT, "model.compile=true"],
    "tiny GPT, 2 x 16, fsdp on 1 device": [*SMALL_GPT, "strategy=fsdp", "trainer.devices=1"],
    "tiny GPT, 2 x 16, ddp on 2": [*SMALL_GPT, "strategy=ddp", "trainer.devices=2"],
    "tiny GPT, 2 x 16, fsdp on 2": [*SMALL_GPT, "strategy=fsdp", "trainer.devices=2"],
    "MLP, batch 8": ["data.batch_size=8", "data.num_train=2048"],
    "MLP, batch 64 (the default run)": [],
    "tiny GPT, 32 x 64 (its default)": ["model=gpt", "data=tokens", "data.num_train=1024"],
}
PREDICTED = re.compile(r"Predicted on \S+: ([\d.e-]+) s a step .*?the host's share (\d+)%")


def predicted(overrides: list[str], cluster: str) -> tuple[float, int]:
    command = [sys.executable, "train.py", "plan=true", f"cluster={cluster}", *overrides]
    output = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, check=True).stdout
    found = PREDICTED.search(output)
    assert found is not None, output[-2000:]
    return float(found[1]), int(found[2])


def measured(overrides: list[str], env: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "train.py", *overrides, "logger=csv", "trainer.max_epochs=4", f"hydra.run.dir={tmp}"]
        subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=True)
        with open(Path(tmp) / "csv" / "version_0" / "metrics.csv") as file:
            rates = [float(row["perf/samples_per_sec_per_device"]) for row in csv.DictReader(file)]
    batch = next((int(item.split("=")[1]) for item in overrides if item.startswith("data.batch_size=")), None)
    batch = batch or (32 if "data=tokens" in overrides else 64)
    return batch / statistics.median(rates[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="cpu_2core", help="the cluster of this CPU (calibrate --cpu)")
    parser.add_argument("--cases", nargs="*", default=list(CASES), help="which cases (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case, in rounds over the cases")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"load average before: {os.getloadavg()[0]:.2f}, cores: {cores}, cluster={args.cluster}")
    steps: dict[str, list[float]] = {case: [] for case in args.cases}
    for _ in range(args.repeats):  # rounds, so that a busy spell of the machine slows one run of each case
        for case in args.cases:
            overrides = CASES[case]
            processes = 2 if "trainer.devices=2" in overrides else 1
            env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(max(1, cores // processes))}
            steps[case].append(measured(overrides, env))
    print("| case | predicted s a step | host's share | measured s a step, fastest / median run | error |")
    print("|---|---|---|---|---|")
    for case in args.cases:
        step, share = predicted(CASES[case], args.cluster)
        fastest, median = min(steps[case]), statistics.median(steps[case])
        error = f"{step / fastest - 1:+.1%} / {step / median - 1:+.1%}"
        print(f"| {case} | {step:.4f} | {share}% | {fastest:.4f} / {median:.4f} | {error} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
