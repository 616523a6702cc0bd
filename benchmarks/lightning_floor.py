"""Lightning's own cost per training step (docs/speed.md): ``python benchmarks/lightning_floor.py``.

In one process, the default run's MLP (256 -> 1024 -> 512 -> 10, SGD momentum, batches of 64 drawn from tensors in
memory) trains 128 steps a round: by a plain loop, then by a bare ``lightning.Trainer`` (no logger, callbacks,
checkpoints, progress bar or model summary) on the same batches. Printed: milliseconds per step of each, over the
rounds after the first (warm-up). The difference is what any Lightning-based trainer pays per step here.
"""

import time
import warnings

import lightning as L
import torch
from torch import nn

STEPS, ROUNDS = 128, 3
warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging intervals says nothing here
torch.manual_seed(0)
inputs, targets = torch.randn(8192, 256), torch.randint(0, 10, (8192,))
loss_fn = nn.CrossEntropyLoss()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, len(inputs), (64,))
    return inputs[rows], targets[rows]


def plain_loop_ms() -> float:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.003, momentum=0.9)
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(STEPS):
            x, y = batch()
            loss_fn(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        times.append((time.perf_counter() - start) / STEPS * 1000)
    return sum(times[1:]) / len(times[1:])


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return loss_fn(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.003, momentum=0.9)


class Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch()


class EpochClock(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.times.append((time.perf_counter() - self._start) / STEPS * 1000)


def lightning_ms() -> float:
    clock = EpochClock()
    trainer = L.Trainer(
        max_epochs=ROUNDS,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(Module(), torch.utils.data.DataLoader(Batches(), batch_size=None))
    return sum(clock.times[1:]) / len(clock.times[1:])


if __name__ == "__main__":
    plain, lightning = plain_loop_ms(), lightning_ms()
    print(
        f"plain loop {plain:.2f} ms/step, bare Lightning {lightning:.2f} ms/step, "
        f"difference {lightning - plain:.2f} ms ({lightning / plain - 1:.0%})"
    )
