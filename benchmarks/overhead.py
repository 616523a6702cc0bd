"""What the framework costs over a hand-written loop: ``python benchmarks/overhead.py [--pairs N] [--cases ...]``.

For each case (model x strategy), runs ``python train.py`` (A) and ``benchmarks/hand_loop.py`` (B: the same model,
data, batch, optimizer, validation and per-epoch checkpoint, written by hand) in alternating pairs, so that a noisy
machine slows both alike; a ``-compile`` case (``gpt-auto-compile``) compiles each block in both. Both are timed
by this benchmark's own clock: wall-clock stamps at each epoch's start and at the end of training, written by
rank 0 (``benchmarks/clock.py`` inside the framework run). Printed per case:

- steady state: A / B per-epoch time, over the epochs after the first of each run (min, median, max of the
  pairs' ratios of medians), with the epoch times themselves;
- start-up: from the command's start to the end of the first training step, for each.

Multi-process cases start the hand loop with torchrun; the framework starts its own workers. Both run with the
same intra-op threads, pinned by ``OMP_NUM_THREADS``: the cores split between the case's processes (what the
framework takes on a quiet machine; left to itself it takes fewer on a loaded one, the hand loop torch's default).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODELS = {
    # The default run: python train.py (MLP 256-1024-512-10, batch 64, 128 steps and 2048 validation samples an epoch).
    "mlp": [],
    # The tiny GPT on the Markov language, 32 steps an epoch.
    "gpt": ["model=gpt", "data=tokens", "data.num_train=1024"],
}
STRATEGIES = {
    "auto": [],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "fsdp": ["strategy=fsdp", "trainer.devices=2"],
    "pipeline": ["strategy=pipeline", "trainer.devices=2"],
}


def read_clock(path: Path) -> tuple[list[float], float]:
    """Epoch durations (from one epoch's start to the next, the last to the end) and the first step's end."""
    events = [json.loads(line) for line in path.read_text().splitlines()]
    stamps = [event["time"] for event in events if event["event"] in ("epoch_start", "end")]
    first_step = next(event["time"] for event in events if event["event"] == "first_step")
    return [b - a for a, b in zip(stamps, stamps[1:])], first_step


def run(command: list[str], clock: Path, env: dict[str, str]) -> tuple[list[float], float]:
    start = time.time()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    epochs, first_step = read_clock(clock)
    return epochs, first_step - start


def framework_command(overrides: list[str], clock: Path, job_dir: Path) -> list[str]:
    return [
        sys.executable,
        "train.py",
        *overrides,
        "logger=csv",
        f"hydra.run.dir={job_dir}",
        "+callbacks.clock._target_=benchmarks.clock.EpochClock",
        f"+callbacks.clock.path={clock}",
    ]


def commands(case: str, epochs: int, tmp: Path, pair: int) -> tuple[list[str], list[str], Path, Path]:
    """The case's two commands, A and B, and their clock files: the framework and the hand-written loop, both with
    each block compiled for ``<model>-<strategy>-compile``."""
    model, strategy, *compiled = case.split("-")
    a_clock, b_clock = tmp / f"a{pair}.jsonl", tmp / f"b{pair}.jsonl"
    overrides = [*MODELS[model], *STRATEGIES[strategy], f"trainer.max_epochs={epochs}"]
    if compiled:
        overrides.append("model.compile=true")
    launcher = (
        [sys.executable]
        if strategy == "auto"
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    )
    hand = [*launcher, "benchmarks/hand_loop.py", str(b_clock), strategy, *overrides]
    return framework_command(overrides, a_clock, tmp / f"a{pair}"), hand, a_clock, b_clock


def summary(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="A/B pairs per case")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per run (the first is not steady state)")
    parser.add_argument(
        "--cases",
        nargs="*",
        default=[*(f"{m}-{s}" for m in MODELS for s in STRATEGIES), *(f"{m}-auto-compile" for m in MODELS)],
        help="model-strategy cases, e.g. mlp-auto gpt-fsdp; a -compile suffix compiles the blocks in both",
    )
    args = parser.parse_args()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    print(f"load average before: {os.getloadavg()[0]:.2f}, cores: {len(os.sched_getaffinity(0))}")
    print("A is the framework and B the hand-written loop.")
    print(
        "| case | A / B, steady epoch (min / median / max) | epoch s, A | epoch s, B | start-up s, A | start-up s, B |"
    )
    print("|---|---|---|---|---|---|")
    cores = len(os.sched_getaffinity(0))
    for case in args.cases:
        ratios, times, startups = [], {"A": [], "B": []}, {"A": [], "B": []}
        # Both sides get the same threads, pinned: the cores split between the case's processes. Left to the
        # framework, a single run takes its share of the cores the load leaves idle, a hand loop torch's default.
        processes = 1 if case.split("-")[1] == "auto" else 2
        env["OMP_NUM_THREADS"] = str(max(1, cores // processes))
        with tempfile.TemporaryDirectory() as tmp:
            for pair in range(args.pairs):
                a, b, a_clock, b_clock = commands(case, args.epochs, Path(tmp), pair)
                medians = {}
                # Alternate which goes first, so neither always follows the other.
                order = [("A", a, a_clock), ("B", b, b_clock)]
                for name, command, clock in order if pair % 2 == 0 else order[::-1]:
                    epochs, startup = run(command, clock, env)
                    medians[name] = statistics.median(epochs[1:])
                    times[name].append(medians[name])
                    startups[name].append(startup)
                ratios.append(medians["A"] / medians["B"])
        print(
            f"| {case} | {summary(ratios)} | {statistics.median(times['A']):.3f} | {statistics.median(times['B']):.3f} "
            f"| {statistics.median(startups['A']):.2f} | {statistics.median(startups['B']):.2f} |",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
