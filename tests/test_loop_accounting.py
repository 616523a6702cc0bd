"""What the training loop counts, checked inside a real ``Trainer.fit``: the order of the samples each epoch and the
time the throughput metrics divide by (against a clock the test owns)."""

import csv
import types

import lightning as L
import pytest
import torch
from helpers.reference import epoch_order
from torch.utils.data import TensorDataset

import project.observability.throughput as throughput_module
from project.checkpointing import LatestAndBestCheckpoint
from project.data.datamodule import GeneratedDataModule
from project.observability import EpochThroughput
from project.observability.loggers import EpochCSVLogger


class IndexData(GeneratedDataModule):
    """Sample i is the feature i (a float) with label i % 7: the batches say which samples a step saw."""

    def setup(self, stage: str) -> None:
        self.train_set = TensorDataset(torch.arange(self.num_train).float(), torch.arange(self.num_train) % 7)
        self.val_set = TensorDataset(torch.arange(self.num_val).float(), torch.arange(self.num_val) % 7)


class Recorder(L.LightningModule):
    """Records the samples of every training step; each step and each validation step advances ``clock``."""

    def __init__(self, clock: list[float] | None = None, step_seconds: float = 0.0, val_seconds: float = 0.0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: dict[int, list[int]] = {}
        self.clock, self.step_seconds, self.val_seconds = clock, step_seconds, val_seconds

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(self.current_epoch, []).extend(batch[0].long().tolist())
        if self.clock is not None:
            self.clock[0] += self.step_seconds
        return (self.weight - 1.0) ** 2

    def validation_step(self, batch, batch_idx):
        if self.clock is not None:
            self.clock[0] += self.val_seconds

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(module: L.LightningModule, data: L.LightningDataModule, epochs: int, **trainer_args) -> L.Trainer:
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        **trainer_args,
    )
    trainer.fit(module, datamodule=data)
    return trainer


def test_each_epoch_reshuffles_from_seed_and_epoch_only():
    """Lightning itself must advance the epoch of the shuffle; a sampler that never reshuffles fails here."""
    data = IndexData(num_train=96, num_val=8, batch_size=16, seed=5)
    recorder = Recorder()
    fit(recorder, data, epochs=3)
    for epoch in range(3):
        assert recorder.seen[epoch] == epoch_order(96, 5, epoch).tolist()
    assert recorder.seen[0] != recorder.seen[1] != recorder.seen[2]
    again = Recorder()
    fit(again, IndexData(num_train=96, num_val=8, batch_size=16, seed=5), epochs=3)
    assert again.seen == recorder.seen  # the same seed gives the same epochs in a new process state


@pytest.fixture
def fake_clock(monkeypatch) -> list[float]:
    """The throughput callback's clock, moved only by the test's training and validation steps."""
    clock = [1000.0]
    monkeypatch.setattr(throughput_module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return clock


@pytest.mark.parametrize("val_seconds", [0.0, 5.0])
def test_throughput_counts_training_time_only(fake_clock, val_seconds):
    """8 steps of 16 samples at 0.5 s each: 32 samples/s however long validation takes; the epoch time has it all."""
    data = IndexData(num_train=128, num_val=24, batch_size=16, seed=0)
    trainer = fit(
        Recorder(fake_clock, step_seconds=0.5, val_seconds=val_seconds), data, epochs=2, callbacks=[EpochThroughput()]
    )
    metrics = trainer.logged_metrics
    assert metrics["perf/samples_per_sec"].item() == pytest.approx(32.0)
    assert metrics["perf/samples_per_sec_per_device"].item() == pytest.approx(32.0)
    assert metrics["perf/epoch_time_s"].item() == pytest.approx(8 * 0.5 + 2 * val_seconds)  # 2 val batches of 16
    assert "perf/tokens_per_sec" not in metrics  # float inputs are not tokens


def test_throughput_keeps_validation_inside_an_epoch_out(fake_clock):
    """Validation twice per epoch (val_check_interval): the clock pauses for each and resumes with training."""
    data = IndexData(num_train=128, num_val=24, batch_size=16, seed=0)
    trainer = fit(
        Recorder(fake_clock, step_seconds=0.5, val_seconds=3.0),
        data,
        epochs=1,
        val_check_interval=4,
        callbacks=[EpochThroughput()],
    )
    assert trainer.logged_metrics["perf/samples_per_sec"].item() == pytest.approx(32.0)
    assert trainer.logged_metrics["perf/epoch_time_s"].item() == pytest.approx(8 * 0.5 + 2 * 2 * 3.0)


class TokenData(GeneratedDataModule):
    """Sequences of 12 token ids: a batch of 16 holds 192 tokens."""

    def setup(self, stage: str) -> None:
        tokens = torch.randint(0, 50, (self.num_train + self.num_val, 12), generator=torch.Generator().manual_seed(0))
        self.train_set = TensorDataset(tokens[: self.num_train], tokens[: self.num_train])
        self.val_set = TensorDataset(tokens[self.num_train :], tokens[self.num_train :])


def test_tokens_per_second_counts_every_input_token(fake_clock):
    data = TokenData(num_train=64, num_val=16, batch_size=16, seed=0)
    recorder = Recorder(fake_clock, step_seconds=0.25, val_seconds=7.0)
    recorder.training_step = lambda batch, batch_idx: Recorder.training_step(
        recorder, (batch[0][:, 0].float(), None), batch_idx
    )
    trainer = fit(recorder, data, epochs=1, callbacks=[EpochThroughput()])
    assert trainer.logged_metrics["perf/tokens_per_sec"].item() == pytest.approx(16 * 12 / 0.25)
    assert trainer.logged_metrics["perf/samples_per_sec"].item() == pytest.approx(16 / 0.25)


class ValidatedRecorder(Recorder):
    """Logs a validation loss, the metric the checkpoints monitor."""

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", (self.weight - 1.0) ** 2)


class LastCheckpointStep(L.Callback):
    """The step of ``last.ckpt`` as each training batch starts, by the steps taken then."""

    def __init__(self, path) -> None:
        self.path, self.seen = path, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.path.exists():
            self.seen[trainer.global_step] = torch.load(self.path, weights_only=False)["global_step"]


@pytest.mark.parametrize(
    "every_n_train_steps, val_check_interval, saved_at",
    [
        (3, 1.0, [3, 6, 8, 9, 12, 15]),  # step saves before the first validation too (Lightning waits for its metric)
        (None, 3, [3, 6, 8, 11, 14]),  # each validation, and each epoch's end though no validation ends it
    ],
)
def test_last_checkpoint_is_written_at_every_save_point(tmp_path, every_n_train_steps, val_check_interval, saved_at):
    """2 epochs of 8 steps; last.ckpt, read as each step starts, holds the latest save point's step."""
    last = tmp_path / "last.ckpt"
    probe = LastCheckpointStep(last)
    checkpoint = LatestAndBestCheckpoint(
        dirpath=tmp_path, monitor="val/loss", save_last=True, every_n_train_steps=every_n_train_steps
    )
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        callbacks=[probe, checkpoint],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        val_check_interval=val_check_interval,
    )
    trainer.fit(ValidatedRecorder(), datamodule=IndexData(num_train=128, num_val=16, batch_size=16, seed=0))
    expected = {step: max((s for s in saved_at if s <= step), default=None) for step in range(16)}
    assert probe.seen == {step: saved for step, saved in expected.items() if saved is not None}
    assert torch.load(last, weights_only=False)["global_step"] == 16


class EpochLoggingRecorder(ValidatedRecorder):
    """Also logs a training loss per epoch, as the project's modules do."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        return loss


def test_csv_rows_of_validations_within_epochs_keep_their_steps(tmp_path):
    """Validation every 3 of an epoch's 8 steps: rows at steps 3 and 6, the epoch's training numbers at step 8 on
    their own (no validation ends the epoch), and so on in epoch 1."""
    logger = EpochCSVLogger(save_dir=tmp_path, name="", version=0)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        val_check_interval=3,
    )
    trainer.fit(EpochLoggingRecorder(), datamodule=IndexData(num_train=128, num_val=16, batch_size=16, seed=0))
    with open(tmp_path / "version_0" / "metrics.csv") as file:
        rows = [{key for key, value in row.items() if value != ""} | {int(row["step"])} for row in csv.DictReader(file)]
    assert rows == [
        {"epoch", "step", "val/loss", 3},
        {"epoch", "step", "val/loss", 6},
        {"epoch", "step", "train/loss", 8},
        {"epoch", "step", "val/loss", 11},
        {"epoch", "step", "val/loss", 14},
        {"epoch", "step", "train/loss", 16},
    ]
