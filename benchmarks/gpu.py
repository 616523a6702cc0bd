"""The framework's speed on one GPU: ``python benchmarks/gpu.py --out DIR [--pairs N] [--profile [all]]``.

Cases: GPT-2 small and medium (``model=gpt_125m``, ``model=gpt_350m``) and Llama-3.2-1B's shape (``model=llama_1b``),
each eager and with ``model.compile=true``, and the last two also with ``model.float8.enabled=true`` (``-float8``) and
compiled with ``model.fused_loss=true`` (``-fusedloss``: the output layer and loss in chunks), on one GPU in
``bf16-mixed``, on the synthetic Markov language
(``data=tokens``, nothing to download) at sequence length 1024 (``--seq-length``), 2 epochs (``--epochs``) of 40
steps (``--steps``), checkpointing off. For each case, ``python train.py`` (the framework) and
``benchmarks/hand_loop.py`` (the same training written by hand) run one after the other in alternating order,
``--pairs`` times, both timed by ``benchmarks/overhead.py``'s clock. Reported per case, over the epochs after the
first (steady state: compiling, warm-up and the first validation are in the first):

- ``perf/tokens_per_sec``, ``perf/tflops_per_device`` and ``perf/mfu`` as the framework logs them (its CSV log;
  the median of the steady epochs), and ``memory/peak_allocated_mb``, the highest of the run's epochs;
- framework / hand throughput: the hand loop's steady epoch time over the framework's (the medians of each run;
  min / median / max over the pairs). 1 means the framework costs nothing; 0.98, that it is 2% slower.
- a Float8 or fused-loss case's throughput over its plain twin's (``perf/tokens_per_sec``): the same case in bf16, with
  the loss of the whole logits.

One more case, ``checkpoint-save``: what a checkpoint save costs the training loop. gpt_125m (eager) under
``strategy=fsdp`` on the one GPU (a distributed checkpoint: about 1.5 GB of fp32 weights and AdamW state) saves
``last.ckpt`` every 10 steps, written synchronously (``async_save=false``) and in the background (``true``); a third
run saves nothing. A save's stall is the steady epoch time's excess over the run without saves, over the saves of an
epoch.

Targets, printed next to the figures: gpt_350m compiled at 50% MFU or more, llama_1b compiled at 40% or more, every
case's framework / hand throughput at 0.98 or more (its median over the pairs), llama_1b compiled in Float8 at 1.2x
its bf16 throughput or more, and a background save stalling training less than a fifth of a synchronous one.
``--profile`` then traces a few steps of a framework run (``ProfileSteps``) of every case that missed a target
(``--profile all``: of every case). ``--framework-only``: no hand loop, the framework's figures alone (``make
gpu-collect``'s cases, in a lease too short for both).

Prints the tables and writes them to ``--out`` (if given) after each case, so that a run cut short keeps what it
measured: ``gpu_benchmark.json`` (every figure, the machine, the command) and ``gpu_benchmark.md``; with ``--profile``
``gpu_benchmark_kernels.txt`` (each profiled case's 20 heaviest ops by device time) and one chrome trace,
``gpu_benchmark_trace.json.gz`` (the first profiled case's). Exits 1 if a run failed; a missed target is a finding,
not a failure.

Estimated at 7 minutes on an H100 with ``--pairs 1`` for the six bf16 cases: on an H200 (2026-11-26, docs/gpu.md)
the compiled gpt_350m and llama_1b cases took 68 s and 92 s each (a framework and a hand run; each run's wall time is
in the JSON: start-up, data generation and compiling are about half of it). The Float8 cases and ``checkpoint-save``
have not been timed on a GPU; ``make gpu-check`` can run them as a part of their own (``GPU_BENCHMARK_CASES``,
docs/gpu.md). About 40 s more per profiled case. Without CUDA it exits with 2, unless ``--smoke``: the same pipeline
on the CPU with the tiny presets (``model=gpt`` and ``model=llama``, eager, ``32-true``, sequence 64, 8 steps an
epoch; the Llama in Float8 too, emulated), in a few minutes on 2 cores, to check the code; its figures are of no
worth.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from gpu_report import machine  # noqa: E402  (date, GPU, torch, CUDA, Python: as make gpu-check's tables)
from overhead import framework_command, run, summary  # noqa: E402
from readme_figures import QUIET, epochs, table  # noqa: E402  (QUIET: CSV log, no progress bar, no config print)

RATIO_TARGET = 0.98  # framework throughput / hand-loop throughput, i.e. framework epoch time <= hand time / 0.98
# The Markov language keeps data=tokens' small vocabulary: its generator holds a dense vocab x vocab transition matrix
# and iterates it 10,000 times towards its stationary distribution (vocab 4096 already takes minutes of CPU, 128256
# would need 66 GB), and draws every token from a row of it. The models get their real vocabularies through
# model.net.vocab_size: the embedding, the output layer and the loss cost the same whichever token ids occur.
DATA_VOCAB = 64
PROFILE_START, PROFILE_STEPS = 5, 3  # after the first steps (compiling, warm-up), a few steady ones
TRACE_LIMIT = 16 * 2**20  # bytes: a larger chrome trace is left out
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


@dataclass(frozen=True)
class Model:
    preset: str  # model=<preset>
    vocab_size: int | None  # the model's vocabulary (model.net.vocab_size); None: the data's
    batch_size: int  # sequences per step (one device)
    float8: bool = False  # also run in Float8 (model.float8.enabled=true)
    fused_loss: bool = False  # also run compiled with the fused output layer and loss (model.fused_loss=true)


@dataclass(frozen=True)
class Case:
    model: Model
    compile: bool
    float8: bool = False
    fused_loss: bool = False

    @property
    def name(self) -> str:
        return (
            f"{self.model.preset}{'-compile' if self.compile else ''}{'-float8' if self.float8 else ''}"
            f"{'-fusedloss' if self.fused_loss else ''}"
        )

    @property
    def twin(self) -> "Case":
        """The same case in bf16 with the loss of the whole logits."""
        return Case(self.model, self.compile)


# GPT-2's 50257 tokens rounded up to a multiple of 64 (nanoGPT's 50304: whole tensor-core tiles); Llama 3's own
# 128256, which makes llama_1b the 1.24 B-parameter model its preset names. The batches keep the GPU busy and well
# inside an H100's 80 GB: the memory plan (python train.py plan=true with these overrides) puts the peaks at 16.5 GiB,
# 29 GiB and 46 GiB; llama_1b's model state alone is 1.24 B x 16 bytes = 20 GB (fp32 weights and gradients, two
# fp32 AdamW moments), its activations at 8 x 1024 tokens 22 GiB.
GPU_MODELS = [
    # The tiny GPT (2 blocks of width 128) at 2 sequences: a step the host sets the pace of, eager and compiled, where
    # the framework's own host time per step shows most (docs/speed.md); plan=true's host term is checked on it.
    Model("gpt", None, 2),
    Model("gpt_125m", 50304, 16),
    Model("gpt_350m", 50304, 16, float8=True, fused_loss=True),
    Model("llama_1b", 128256, 8, float8=True, fused_loss=True),
]
GPU_MFU_TARGETS = {"gpt_350m-compile": 0.50, "gpt_350m-compile-fusedloss": 0.50, "llama_1b-compile": 0.40}
GPU_FLOAT8_TARGETS = {"llama_1b-compile-float8": 1.2}  # Float8 throughput / bf16's (torchtitan: 1.2-1.5x)
GPU_ARGS = ["trainer.accelerator=gpu", "trainer.devices=1", "trainer.precision=bf16-mixed"]
# --smoke: the tiny presets on the CPU, eager (compiling takes about 35 s a run on a CPU). The GPU's MFU targets are
# held against them too, so that a missing perf/mfu (no peak on a CPU) goes through the same path.
SMOKE_MODELS = [Model("gpt", None, 8), Model("llama", None, 8, float8=True, fused_loss=True)]
SMOKE_MFU_TARGETS = {"gpt": 0.50, "llama": 0.40}
SMOKE_FLOAT8_TARGETS = {"llama-float8": 1.2}
SMOKE_ARGS = ["trainer.accelerator=cpu", "trainer.devices=1", "trainer.precision=32-true"]
# Checkpointing off on both sides (hand_loop.py reads the same switch): a llama_1b checkpoint is 15 GB of weights and
# AdamW state, whose writing would time the disk, not the training.
NO_CHECKPOINTS = ["~callbacks.model_checkpoint", "+trainer.enable_checkpointing=false"]
# checkpoint-save: a distributed checkpoint of last.ckpt alone every SAVE_EVERY steps (no best one: top-k 0).
CHECKPOINT_CASE = "checkpoint-save"
SAVE_EVERY = 10
SAVES = ["strategy=fsdp", "callbacks.model_checkpoint.save_top_k=0"]
STALL_TARGET = 5.0  # a synchronous save's stall / a background one's: the background one under a fifth


class ProfileSteps(L.Callback):
    """A ``torch.profiler`` trace of the optimizer steps ``start`` to ``start + steps - 1`` of a framework run, added as
    ``+callbacks.profile._target_=benchmarks.gpu.ProfileSteps``: writes the 20 heaviest ops (by device time on a GPU,
    CPU time otherwise) as a table to ``ops_file`` and, with ``trace_file``, the chrome trace there (gzipped if it
    ends in .gz). The run should stop after them (``trainer.max_steps``)."""

    def __init__(self, ops_file: str, start: int, steps: int, trace_file: str | None = None) -> None:
        self.ops_file, self.start, self.steps, self.trace_file = ops_file, start, steps, trace_file
        self._profiler: profile | None = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.start and self._profiler is None:
            cuda = pl_module.device.type == "cuda"
            self._profiler = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])])
            self._profiler.__enter__()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._profiler is None or trainer.global_step != self.start + self.steps:
            return
        cuda = pl_module.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(pl_module.device)  # the steps' kernels into the trace
        self._profiler.__exit__(None, None, None)
        averages = self._profiler.key_averages()
        Path(self.ops_file).write_text(
            averages.table(sort_by="device_time_total" if cuda else "cpu_time_total", row_limit=20)
        )
        if self.trace_file:
            self._profiler.export_chrome_trace(self.trace_file)


def case_overrides(
    model: Model,
    compile: bool,
    args: argparse.Namespace,
    device_args: list[str],
    float8: bool = False,
    fused_loss: bool = False,
) -> list[str]:
    """The Hydra overrides of one case, the same for the framework and the hand loop."""
    vocab = (
        []
        if model.vocab_size is None
        else [f"data.vocab_size={DATA_VOCAB}", f"model.net.vocab_size={model.vocab_size}"]
    )
    return [
        f"model={model.preset}",
        "data=tokens",
        *vocab,
        f"data.seq_length={args.seq_length}",
        f"data.batch_size={model.batch_size}",
        f"data.num_train={args.steps * model.batch_size}",
        f"data.num_val={2 * model.batch_size}",  # two whole batches: no odd last one to compile again
        f"trainer.max_epochs={args.epochs}",
        f"model.compile={str(compile).lower()}",
        f"model.float8.enabled={str(float8).lower()}",
        f"model.fused_loss={str(fused_loss).lower()}",
        *device_args,
        *QUIET,
        *NO_CHECKPOINTS,
    ]


def steady_median(rows: list[dict[str, float]], key: str) -> float | None:
    """The median of ``key`` over the epochs after the first (None where the run logged none: perf/mfu on a CPU)."""
    values = [row[key] for row in rows if row.get("epoch", 0) >= 1 and key in row]
    return statistics.median(values) if values else None


def median_or_none(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def measure(name: str, overrides: list[str], pairs: int, first: int, tmp: Path, hand: bool = True) -> dict[str, Any]:
    """Runs the framework and the hand loop ``pairs`` times, in alternating order (``first``: which goes first in the
    first pair, 0 the framework), and returns the case's figures; without ``hand``, the framework alone."""
    runs: dict[str, list[dict[str, Any]]] = {"framework": [], "hand": []} if hand else {"framework": []}
    logs = []
    for pair in range(pairs):
        clocks = {side: tmp / f"{name}-{pair}-{side}.jsonl" for side in ("framework", "hand")}
        job_dir = tmp / f"{name}-{pair}"
        commands = {
            "framework": framework_command(overrides, clocks["framework"], job_dir),
            "hand": [sys.executable, "benchmarks/hand_loop.py", str(clocks["hand"]), "auto", *overrides],
        }
        for side in list(runs) if (first + pair) % 2 == 0 else reversed(runs):
            start = time.perf_counter()
            epoch_s, startup_s = run(commands[side], clocks[side], ENV)
            runs[side].append({"epoch_s": epoch_s, "startup_s": startup_s, "wall_s": time.perf_counter() - start})
            print(
                f"  {name} {side}: epochs {', '.join(f'{s:.2f}' for s in epoch_s)} s, "
                f"run {runs[side][-1]['wall_s']:.0f} s",
                flush=True,
            )
        logs.append([row for row in epochs(job_dir) if "perf/tokens_per_sec" in row])  # the training rows
    steady = {side: [statistics.median(r["epoch_s"][1:]) for r in side_runs] for side, side_runs in runs.items()}
    ratios = [hand / framework for framework, hand in zip(steady["framework"], steady.get("hand", []))]
    peaks = [row["memory/peak_allocated_mb"] for rows in logs for row in rows if "memory/peak_allocated_mb" in row]
    return {
        **{
            key: median_or_none([steady_median(rows, f"perf/{key}") for rows in logs])
            for key in ("tokens_per_sec", "tflops_per_device", "mfu")
        },
        "peak_allocated_mb": max(peaks) if peaks else None,
        "epoch_s": {side: statistics.median(times) for side, times in steady.items()},
        "throughput_ratio": (
            {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios), "pairs": ratios}
            if ratios
            else None
        ),
        "runs": runs,
        "framework_epochs": logs,
    }


def measure_checkpoint_stall(overrides: list[str], steps: int, tmp: Path) -> dict[str, Any]:
    """``checkpoint-save``: the framework run of ``overrides`` without checkpoints, saving last.ckpt synchronously
    every ``SAVE_EVERY`` steps, and saving it in the background; each save's stall over the run without saves."""
    trained = [item for item in overrides if item not in NO_CHECKPOINTS]
    every = min(SAVE_EVERY, max(1, steps // 2))  # at least two saves an epoch (--smoke's epochs are 8 steps)
    saving = [*trained, *SAVES, f"callbacks.model_checkpoint.every_n_train_steps={every}"]
    runs = {
        "none": overrides,
        "synchronous": [*saving, "callbacks.model_checkpoint.async_save=false"],
        "background": [*saving, "callbacks.model_checkpoint.async_save=true"],
    }
    epoch_s = {}
    for kind, args in runs.items():
        clock, job_dir = tmp / f"checkpoints-{kind}.jsonl", tmp / f"checkpoints-{kind}"
        times, _ = run(framework_command(args, clock, job_dir), clock, ENV)
        epoch_s[kind] = statistics.median(times[1:])
        print(f"  {CHECKPOINT_CASE} {kind}: epochs {', '.join(f'{t:.2f}' for t in times)} s", flush=True)
    saves = steps // every
    stall = {kind: (epoch_s[kind] - epoch_s["none"]) / saves for kind in ("synchronous", "background")}
    return {"epoch_s": epoch_s, "saves_per_epoch": saves, "stall_s": stall, "overrides": runs}


def targets(
    results: list[dict[str, Any]], mfu_targets: dict[str, float], float8_targets: dict[str, float]
) -> list[dict[str, Any]]:
    """Each target with the measured value and whether it is met (None: not measured)."""
    checks = []
    for result in results:
        name = result["case"]
        if name == CHECKPOINT_CASE:
            stall = result.get("stall_s", {})
            background, synchronous = stall.get("background"), stall.get("synchronous")
            value = None if background is None or synchronous is None else synchronous / max(background, 1e-6)
            met = None if value is None else value >= STALL_TARGET
            checks.append(
                {"case": name, "metric": "synchronous / background stall", "threshold": STALL_TARGET,
                 "value": value, "met": met}
            )  # fmt: skip
            continue
        wanted = [("perf/mfu", result.get("mfu"), mfu_targets[name])] if name in mfu_targets else []
        if name in float8_targets:
            wanted.append(("Float8 / bf16 throughput", result.get("twin_speedup"), float8_targets[name]))
        wanted.append(
            ("framework / hand throughput", (result.get("throughput_ratio") or {}).get("median"), RATIO_TARGET)
        )
        for metric, value, threshold in wanted:
            checks.append(
                {
                    "case": name,
                    "metric": metric,
                    "threshold": threshold,
                    "value": value,
                    "met": None if value is None else value >= threshold,
                }
            )
    return checks


def figure(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    rows, stalls, saves = [], [], None
    for r in report["cases"]:
        if r["case"] == CHECKPOINT_CASE:
            if "error" in r:
                stalls.append(["failed: see the JSON", "", ""])
                continue
            epoch_s, stall, saves = r["epoch_s"], r["stall_s"], r["saves_per_epoch"]
            for kind in ("none", "synchronous", "background"):
                per_save = "-" if kind == "none" else f"{stall[kind]:.3f}"
                stalls.append([kind, f"{epoch_s[kind]:.3f}", per_save])
            continue
        if "error" in r:
            rows.append([r["case"], f"{r['batch_size']} x {r['seq_length']}", "failed: see the JSON", *[""] * 7])
            continue
        ratio = r["throughput_ratio"]  # None: the framework alone (--framework-only)
        rows.append(
            [
                r["case"],
                f"{r['batch_size']} x {r['seq_length']}",
                figure(r["tokens_per_sec"], "{:,.0f}"),
                figure(r["tflops_per_device"], "{:.1f}"),
                figure(r["mfu"], "{:.1%}"),
                figure(r["peak_allocated_mb"], "{:,.0f}"),
                f"{r['epoch_s']['framework']:.3f}",
                figure(r["epoch_s"].get("hand"), "{:.3f}"),
                "n/a" if ratio is None else summary([ratio["min"], ratio["median"], ratio["max"]]),
                figure(r.get("twin_speedup"), "{:.3f}"),
            ]
        )
    checks = [
        [
            f"{c['case']}: {c['metric']} >= {c['threshold']}",
            figure(c["value"], "{:.3f}"),
            {True: "met", False: "missed", None: "not measured"}[c["met"]],
        ]
        for c in report["targets"]
    ]
    lines = [
        f"GPU: {m['gpu'] or 'none (CPU smoke run)'}; torch {m['torch']} (CUDA {m['cuda']}), Lightning "
        f"{m['lightning']}; {m['date']}. Reproduce: `{report['command']}` ({report['wall_s'] / 60:.1f} min).",
        "",
        f"Steady state: the epochs after the first of {report['settings']['epochs']} epochs of "
        f"{report['settings']['steps']} steps; {report['settings']['pairs']} framework / hand-loop pair(s) per case. "
        "tokens/s, TFLOPS and MFU as the framework logs them (training time only); epoch times by the benchmark's "
        "clock (validation included); framework / hand throughput = hand epoch time / framework epoch time "
        "(min / median / max over pairs).",
        "",
        table(
            [
                "case",
                "batch x seq",
                "tokens/s",
                "TFLOPS / device",
                "MFU",
                "peak allocated MiB",
                "epoch s, framework",
                "epoch s, hand",
                "framework / hand throughput",
                "throughput / plain twin's",
            ],
            rows,
        ),
        "",
    ]
    if stalls:
        lines += [
            f"`{CHECKPOINT_CASE}`: {report['settings'].get('checkpoint_model', '')} under strategy=fsdp on one device, "
            f"last.ckpt saved {saves} times an epoch; a save's stall is the steady epoch's excess over the run "
            "without saves, over the epoch's saves.",
            "",
            table(["checkpoints", "epoch s", "stall s per save"], stalls),
            "",
        ]
    lines += [
        table(["target", "measured", ""], checks),
    ]
    if report["profiles"]:
        lines += [
            "",
            "Profiled (`--profile`): " + ", ".join(report["profiles"]) + "; top-20 ops by device time in "
            "`gpu_benchmark_kernels.txt`" + (f", chrome trace `{report['trace']}`." if report["trace"] else "."),
        ]
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: Path | None) -> str:
    """The report's markdown, also written with the JSON into ``out`` (if given)."""
    text = markdown(report)
    if out is not None:
        (out / "gpu_benchmark.json").write_text(json.dumps(report, indent=1))
        (out / "gpu_benchmark.md").write_text(text)
    return text


def profile_case(name: str, overrides: list[str], tmp: Path, trace: Path | None) -> str:
    """A framework run of the case up to the profiled steps; returns their table."""
    ops_file = tmp / f"{name}-profile.txt"
    extra = [
        f"trainer.max_steps={PROFILE_START + PROFILE_STEPS}",
        "+callbacks.profile._target_=benchmarks.gpu.ProfileSteps",
        f"+callbacks.profile.ops_file={ops_file}",
        f"+callbacks.profile.start={PROFILE_START}",
        f"+callbacks.profile.steps={PROFILE_STEPS}",
        *([f"+callbacks.profile.trace_file={trace}"] if trace else []),
    ]
    job_dir = tmp / f"{name}-profile"
    run(framework_command([*overrides, *extra], job_dir / "clock.jsonl", job_dir), job_dir / "clock.jsonl", ENV)
    return ops_file.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where the JSON and markdown go (none: printed only)")
    parser.add_argument("--pairs", type=int, default=1, help="framework / hand-loop pairs per case")
    parser.add_argument(
        "--framework-only", action="store_true", help="no hand loop: the framework's figures alone (make gpu-collect)"
    )
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run (at least 2: the first is warm-up)")
    parser.add_argument("--steps", type=int, default=None, help="steps per epoch (default 40; 8 with --smoke)")
    parser.add_argument(
        "--seq-length", type=int, default=None, help="tokens per sequence (default 1024; 64 with --smoke)"
    )
    parser.add_argument(
        "--cases",
        nargs="*",
        default=None,
        help="e.g. gpt_350m-compile llama_1b (default: every model, eager and compiled)",
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="missed",
        choices=["missed", "all"],
        default=None,
        help="trace a few steps of the framework run of each case that missed a target (all: of each)",
    )
    parser.add_argument("--smoke", action="store_true", help="the pipeline on the CPU with the tiny presets")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the first epoch is not steady state")
    if args.profile and args.out is None:
        parser.error("--profile writes its tables into --out: name one")
    if not args.smoke and not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py measures a CUDA GPU, and torch sees none here (torch.cuda.is_available() is False). "
            "To check its code on the CPU: python benchmarks/gpu.py --smoke",
            file=sys.stderr,
        )
        sys.exit(2)
    models, mfu_targets, float8_targets, device_args = (
        (SMOKE_MODELS, SMOKE_MFU_TARGETS, SMOKE_FLOAT8_TARGETS, SMOKE_ARGS)
        if args.smoke
        else (GPU_MODELS, GPU_MFU_TARGETS, GPU_FLOAT8_TARGETS, GPU_ARGS)
    )
    if args.steps is None:
        args.steps = 8 if args.smoke else 40
    if args.seq_length is None:
        args.seq_length = 64 if args.smoke else 1024
    compiles = [False] if args.smoke else [False, True]
    every = [
        *(
            Case(model, compile, float8)
            for model in models
            for float8 in ([False, True] if model.float8 else [False])
            for compile in compiles
        ),
        # compiled where there is a GPU: the fused loss is for the MFU target, which is of the compiled case
        *(Case(model, compiles[-1], fused_loss=True) for model in models if model.fused_loss),
    ]
    known = {case.name: case for case in every}
    unknown = set(args.cases or []) - {*known, CHECKPOINT_CASE}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose among {sorted(known)} and {CHECKPOINT_CASE}")
    # In --cases' order: a caller with a budget (make gpu-collect) puts first what it needs most.
    chosen = known if args.cases is None else [name for name in args.cases if name in known]
    cases = {name: known[name] for name in chosen}
    checkpoint_model = next(model for model in models if model.preset == ("gpt" if args.smoke else "gpt_125m"))
    measure_stall = args.cases is None or CHECKPOINT_CASE in args.cases
    if args.out is not None:
        args.out = args.out.resolve()  # the profiled run writes its trace there from the repo's root
        args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "command": shlex.join(["python", "benchmarks/gpu.py", *sys.argv[1:]]),
        "machine": {**machine(), "lightning": L.__version__, "cpus": os.cpu_count()},
        "settings": {
            "epochs": args.epochs,
            "steps": args.steps,
            "seq_length": args.seq_length,
            "pairs": args.pairs,
            "data_vocab_size": DATA_VOCAB,
            "ratio_target": RATIO_TARGET,
            "mfu_targets": mfu_targets,
            "float8_targets": float8_targets,
            "checkpoint_model": checkpoint_model.preset,
        },
        "cases": [],
        "targets": [],
        "profiles": [],
        "trace": None,
        "wall_s": 0.0,
    }
    print(
        f"{report['machine']['gpu'] or 'CPU (smoke)'}, torch {torch.__version__}: {len(cases) + measure_stall} cases, "
        + ("the framework alone" if args.framework_only else f"{args.pairs} pair(s) each"),
        flush=True,
    )
    failed = False
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for index, (name, case) in enumerate(cases.items()):
            model, compile = case.model, case.compile
            overrides = case_overrides(model, compile, args, device_args, case.float8, case.fused_loss)
            result = {
                "case": name,
                "model": model.preset,
                "compile": compile,
                "float8": case.float8,
                "fused_loss": case.fused_loss,
                "batch_size": model.batch_size,
                "seq_length": args.seq_length,
                "model_vocab_size": model.vocab_size,
                "overrides": overrides,
            }
            try:
                # Alternating which side goes first from case to case too: with one pair, half the cases each.
                result.update(measure(name, overrides, args.pairs, index % 2, tmp, not args.framework_only))
            except (RuntimeError, subprocess.TimeoutExpired) as error:  # a failed run; the other cases go on
                print(error, file=sys.stderr)
                result["error"] = str(error)[-4000:]
                failed = True
            twin = next((r for r in report["cases"] if r["case"] == case.twin.name), None)
            if case != case.twin and twin and twin.get("tokens_per_sec") and result.get("tokens_per_sec"):
                result["twin_speedup"] = result["tokens_per_sec"] / twin["tokens_per_sec"]
            report["cases"].append(result)
            report["targets"] = targets(report["cases"], mfu_targets, float8_targets)
            report["wall_s"] = time.perf_counter() - started
            write(report, args.out)
        if measure_stall:
            result = {"case": CHECKPOINT_CASE, "model": checkpoint_model.preset}
            try:
                overrides = case_overrides(checkpoint_model, False, args, device_args)
                result.update(measure_checkpoint_stall(overrides, args.steps, tmp))
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                print(error, file=sys.stderr)
                result["error"] = str(error)[-4000:]
                failed = True
            report["cases"].append(result)
            report["targets"] = targets(report["cases"], mfu_targets, float8_targets)
            report["wall_s"] = time.perf_counter() - started
            write(report, args.out)
        missed = {check["case"] for check in report["targets"] if check["met"] is False}
        profiled = [name for name in cases if args.profile == "all" or (args.profile == "missed" and name in missed)]
        tables = []
        for name in profiled:
            case = cases[name]
            trace = args.out / "gpu_benchmark_trace.json.gz" if report["trace"] is None else None
            print(f"  {name}: profiling steps {PROFILE_START} to {PROFILE_START + PROFILE_STEPS - 1}", flush=True)
            overrides = case_overrides(case.model, case.compile, args, device_args, case.float8, case.fused_loss)
            try:
                ops = profile_case(name, overrides, tmp, trace)
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                print(error, file=sys.stderr)
                failed = True
                continue
            tables.append(f"## {name}\n\n{ops}")
            report["profiles"].append(name)
            if trace is not None and trace.is_file():
                if trace.stat().st_size <= TRACE_LIMIT:
                    report["trace"] = trace.name
                else:
                    trace.unlink()
            (args.out / "gpu_benchmark_kernels.txt").write_text("\n\n".join(tables))
    report["wall_s"] = time.perf_counter() - started
    print(write(report, args.out))
    if args.out is not None:
        print(f"Wrote {args.out / 'gpu_benchmark.md'} and {args.out / 'gpu_benchmark.json'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
