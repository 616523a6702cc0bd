"""What Lightning's own loop costs a step, below anything this project adds: ``python benchmarks/lightning_floor.py``.

A bare ``LightningModule`` (its ``training_step`` the loss of the net, ``configure_optimizers`` SGD with momentum)
trained by a bare ``Trainer`` (no logger, checkpoint, progress bar, summary, validation or callback but this
benchmark's clock), against the same net, batches and optimizer in a hand-written loop, in alternating pairs. The
batches are whole index tensors into tensors in memory on both sides (the DataLoader's sampler yields them, as the
project's does). Printed per net: milliseconds a training step, median over the epochs after the first of each run,
then over the pairs; and Lightning's per step over the hand loop's. ``tiny`` (8 -> 8 -> 10) is nearly all host time,
so its difference is Lightning's loop alone; ``mlp`` is the default run's net and batch (256 -> 1024 -> 512 -> 10, 64
a batch), whose ratio is the least ``benchmarks/overhead.py`` can show for it while the framework runs Lightning's
loop. Threads pinned to the machine's cores (``OMP_NUM_THREADS``), as there.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

STEPS = 128  # a step per batch of 64, as the default run's epoch
BATCH = 64
NETS = {"tiny": (8, [8], 10), "mlp": (256, [1024, 512], 10)}


def net_and_data(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    from project.models import MLP

    inputs, hidden, classes = NETS[name]
    torch.manual_seed(0)
    x, y = torch.randn(STEPS * BATCH, inputs), torch.randint(0, classes, (STEPS * BATCH,))
    return MLP(inputs, hidden, classes), x, y


def optimizer_of(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.003, momentum=0.9)  # the default run's


def lightning_epochs(name: str, epochs: int) -> list[float]:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    net, x, y = net_and_data(name)
    seconds: list[float] = []

    class Bare(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            inputs, targets = batch
            return torch.nn.functional.cross_entropy(self.net(inputs), targets)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_of(self.net)

    class Clock(L.Callback):
        def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            seconds.append(time.perf_counter() - self.start)

    batches = [torch.arange(step * BATCH, (step + 1) * BATCH) for step in range(STEPS)]
    loader = DataLoader(TensorDataset(x, y), sampler=batches, batch_size=None)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Clock()],
    )
    trainer.fit(Bare(), loader)
    return seconds


def hand_epochs(name: str, epochs: int) -> list[float]:
    net, x, y = net_and_data(name)
    optimizer = optimizer_of(net)
    seconds = []
    for _ in range(epochs):
        start = time.perf_counter()
        for step in range(STEPS):
            rows = torch.arange(step * BATCH, (step + 1) * BATCH)
            torch.nn.functional.cross_entropy(net(x[rows]), y[rows]).backward()
            optimizer.step()
            optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    return seconds


def ms_per_step(side: str, name: str, epochs: int) -> float:
    """One run of ``side`` in a fresh process: its median epoch after the first, in ms a step."""
    command = [sys.executable, __file__, "--run", side, name, str(epochs)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=True, timeout=600)
    return float(result.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="Lightning / hand pairs per net")
    parser.add_argument("--epochs", type=int, default=6, help="epochs per run (the first is not steady state)")
    parser.add_argument("--run", nargs=3, help=argparse.SUPPRESS)  # one side's run, in its own process
    args = parser.parse_args()
    if args.run:
        side, name, epochs = args.run
        seconds = (lightning_epochs if side == "lightning" else hand_epochs)(name, int(epochs))
        print(statistics.median(seconds[1:]) / STEPS * 1e3)
        return
    os.environ["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| net | Lightning, ms a step | hand loop, ms a step | Lightning's own, ms a step | Lightning / hand |")
    print("|---|---|---|---|---|")
    for name in NETS:
        times: dict[str, list[float]] = {"lightning": [], "hand": []}
        for pair in range(args.pairs):
            for side in ("lightning", "hand") if pair % 2 == 0 else ("hand", "lightning"):
                times[side].append(ms_per_step(side, name, args.epochs))
        bare, hand = statistics.median(times["lightning"]), statistics.median(times["hand"])
        print(f"| {name} | {bare:.3f} | {hand:.3f} | {bare - hand:.3f} | {bare / hand:.3f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
