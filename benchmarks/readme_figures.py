"""Re-measure the run figures of docs/usage.md (default, batch), docs/fsdp.md (fsdp), docs/model-parallel.md (split)
and docs/models.md (gpt): each table comes from the commands those pages give, read back from the CSV logger
(``<job dir>/csv/version_0/metrics.csv``; W&B runs hold the same values).

    python benchmarks/readme_figures.py             # all tables, a few minutes on 2 CPU cores
    python benchmarks/readme_figures.py gpt fsdp    # some of them: default, batch, fsdp, split, gpt

Speeds depend on the machine and on what else runs on it: note both next to the figures (``uptime``).
"""

import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUIET = ["logger=csv", "print_config=false", "~callbacks.progress_bar", "+trainer.enable_progress_bar=false"]


def run(overrides: list[str], job_dir: Path) -> float:
    """``python train.py <overrides>`` into ``job_dir``; returns its wall time in seconds."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "train.py", *overrides, *QUIET, f"hydra.run.dir={job_dir}"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - start


def epochs(job_dir: Path) -> list[dict[str, float]]:
    """One dict per epoch: the CSV logger's rows (one per epoch, training and validation together)."""
    with open(job_dir / "csv" / "version_0" / "metrics.csv") as file:
        return [
            {key: float(value) for key, value in row.items() if value not in ("", None)} for row in csv.DictReader(file)
        ]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def span(values: list[float], fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(min(values))} - {fmt.format(max(values))}"


def default_run(tmp: Path) -> str:
    seconds = run([], tmp / "default")
    rows = [
        [str(int(e["epoch"])), *(f"{e[key]:.3f}" for key in ("train/loss", "train/acc", "val/loss", "val/acc"))]
        for e in epochs(tmp / "default")
    ]
    return f"`python train.py logger=csv`: {seconds:.0f} s\n\n" + table(
        ["epoch", "train/loss", "train/acc", "val/loss", "val/acc"], rows
    )


def batch_equivalence(tmp: Path) -> str:
    runs = {
        "`data.batch_size=128` (1 process)": ["data.batch_size=128"],
        "`strategy=ddp trainer.devices=2 data.batch_size=64`": [
            "strategy=ddp",
            "trainer.devices=2",
            "data.batch_size=64",
        ],
    }
    rows = []
    for number, (name, overrides) in enumerate(runs.items()):
        job_dir = tmp / f"batch-{number}"
        run(overrides, job_dir)
        for index, e in enumerate(epochs(job_dir)):
            if index in (0, 4):
                rows.append(
                    [
                        name if index == 0 else "",
                        str(index),
                        f"{e['train/loss']:.4f}",
                        f"{e['val/loss']:.4f}",
                        f"{e['val/acc']:.4f}",
                        f"{e['perf/samples_per_sec']:,.0f}",
                    ]
                )
    return table(["run", "epoch", "train/loss", "val/loss", "val/acc", "samples/s"], rows)


def fsdp_memory(tmp: Path) -> str:
    rows = []
    for strategy in ("ddp", "fsdp"):
        for devices in (2, 4):
            job_dir = tmp / f"seed-{strategy}-{devices}"
            run(["experiment=seed_large_model", f"strategy={strategy}", f"trainer.devices={devices}"], job_dir)
            last = epochs(job_dir)[-1]
            rows.append(
                [
                    strategy,
                    str(devices),
                    *(f"{last[f'memory/{part}_mb']:.1f}" for part in ("params", "grads", "model_state")),
                    f"{last['perf/samples_per_sec']:,.0f}",
                    f"{last['val/loss']:.4f}",
                ]
            )
    return table(
        ["strategy", "devices", "params MiB", "grads MiB", "model state MiB / device", "samples/s", "val/loss"], rows
    )


def split_strategies(tmp: Path) -> str:
    runs = {
        "`auto`, one process": [],
        "`model_parallel`, 2 stages": ["strategy=model_parallel", "trainer.devices=2"],
        "`pipeline` (1f1b, 4 micro-batches), 2 stages": ["strategy=pipeline", "trainer.devices=2"],
    }
    rows = []
    for number, (name, overrides) in enumerate(runs.items()):
        job_dir = tmp / f"split-{number}"
        run(overrides, job_dir)
        history = epochs(job_dir)
        rows.append(
            [
                name,
                f"{history[-1]['val/acc']:.3f}",
                span([e["perf/samples_per_sec"] for e in history]),
                f"{history[-1]['memory/model_state_mb']:.2f}",
            ]
        )
    return table(
        ["run", "val/acc after 5 epochs", "samples/s (epochs 0-4)", "memory/model_state_mb (fullest device)"], rows
    )


def gpt(tmp: Path) -> str:
    seconds = run(["model=gpt", "data=tokens"], tmp / "gpt")
    history = epochs(tmp / "gpt")
    floor = history[0]["data/entropy_floor"]
    rows = [
        [
            str(int(e["epoch"])),
            f"{e['train/loss']:.4f}",
            f"{e['val/loss']:.4f}",
            f"{e['val/perplexity']:.3f}",
            f"{100 * (e['val/loss'] / floor - 1):.1f}%",
            f"{e['perf/tokens_per_sec']:,.0f}",
        ]
        for e in history
    ]
    return (
        f"`python train.py model=gpt data=tokens logger=csv`: {seconds:.0f} s, entropy floor {floor:.4f}\n\n"
        + table(["epoch", "train/loss", "val/loss", "val/perplexity", "val/loss above the floor", "tokens/s"], rows)
    )


TABLES = {
    "default": default_run,
    "batch": batch_equivalence,
    "fsdp": fsdp_memory,
    "split": split_strategies,
    "gpt": gpt,
}


def main(tables: dict) -> None:
    """Print the tables named on the command line (all of them by default), each made in a temporary dir."""
    chosen = sys.argv[1:] or list(tables)
    with tempfile.TemporaryDirectory() as tmp:
        for name in chosen:
            print(f"## {name}\n\n{tables[name](Path(tmp))}\n", flush=True)


if __name__ == "__main__":
    main(TABLES)
