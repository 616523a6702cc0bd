"""Peak host memory per rank at start-up: does a sharded or staged rank hold only its part of the model?

Runs ``python train.py`` for the largest GPT preset this machine holds (``model=gpt_1_3b``, untied so that the
pipeline can split it) under auto, fsdp x 4 and pipeline x 4, and stops each rank just before its first training
step. Every rank reports its resident memory before the model exists (the ``setup`` hook: Python, torch, data)
and its peak resident memory up to then (``ru_maxrss``: the model materialised, the optimizer built). Their
difference is what the model cost that rank. The start-up includes Lightning's sanity-check validation, so FSDP's
peak holds the parameters it gathers for one block's forward on top of its shards.

    python benchmarks/startup_memory.py                    # prints a markdown table
    python benchmarks/startup_memory.py model=gpt_125m     # other overrides, e.g. a smaller preset

Not a test: it needs about 12 GB of memory and a few minutes.
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L

REPO = Path(__file__).resolve().parents[1]
# A small batch and one sanity-check batch: start-up memory hardly depends on them, start-up time does (a 1.3 B
# model's forward on 2 CPU cores).
MODEL = [
    "model=gpt_1_3b",
    "data=tokens",
    "model.net.tie_weights=false",
    "data.batch_size=4",
    "trainer.num_sanity_val_steps=1",
]
RUNS = {
    "auto, 1 process": [],
    "fsdp x 4": ["strategy=fsdp", "trainer.devices=4"],
    "pipeline x 4": ["strategy=pipeline", "trainer.devices=4"],
}
MB = 2**20


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class StartupMemory(L.Callback):
    """Writes ``<out>/rank<r>.json`` with the rank's memory before the model, its peak once the model is
    materialised and the optimizer built, and its peak after the sanity-check validation; then ends the run
    (every rank stops here, before any collective of the training step)."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.record: dict[str, int] = {}

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.record["before_model"] = resident_bytes()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["materialised"] = peak_resident_bytes()
        self.record["parameters"] = sum(
            p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in pl_module.parameters()
        )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["sanity_checked"] = peak_resident_bytes()
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))
        raise SystemExit(0)


def measure(overrides: list[str], model: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "train.py",
            *model,
            *overrides,
            "logger=none",
            "print_config=false",
            f"hydra.run.dir={out}/job",
            "~callbacks.progress_bar",
            "~callbacks.model_checkpoint",
            "+callbacks.startup_memory._target_=startup_memory.StartupMemory",
            f"+callbacks.startup_memory.out={out}",
        ]
        # A fixed mmap threshold makes glibc return large freed blocks (FSDP's gathered parameters during the
        # sanity-check validation) to the system at once; with its default, growing threshold they stay resident
        # and the peak would show the allocator's cache, not what the rank holds.
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO / "benchmarks"),
            "WANDB_MODE": "disabled",
            "MALLOC_MMAP_THRESHOLD_": "131072",
        }
        subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True)
        return [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank*.json"))]


def main() -> None:
    model = [*MODEL, *sys.argv[1:]]
    print(f"`python train.py {' '.join(model)}` and:\n")
    print(
        "| run | parameters per rank (M) | resident before the model (MiB) | peak, model materialised (MiB) | "
        "peak after the sanity check (MiB) | the model's cost: materialised - before (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    for name, overrides in RUNS.items():
        ranks = measure(overrides, model)

        def column(key: str, scale: float = MB, ranks: list = ranks) -> str:
            values = [rank[key] / scale for rank in ranks]
            return (
                f"{min(values):,.0f}" if max(values) - min(values) < 1 else f"{min(values):,.0f} - {max(values):,.0f}"
            )

        cost = [(rank["materialised"] - rank["before_model"]) / MB for rank in ranks]
        print(
            f"| {name} | {column('parameters', 1e6)} | {column('before_model')} | {column('materialised')} | "
            f"{column('sanity_checked')} | {min(cost):,.0f} - {max(cost):,.0f} |"
        )


if __name__ == "__main__":
    main()
