"""The fast-path switches that need no run: TF32 for GPU runs only, the progress bar's redraws by time."""

import torch
from lightning.pytorch.callbacks import RichProgressBar

from project.launch.training import set_tf32
from project.observability import progress
from project.observability.progress import TimedRichProgressBar


def test_tf32_is_switched_for_gpu_runs_only():
    before = torch.get_float32_matmul_precision()
    try:
        set_tf32(True, torch.device("cpu"))
        assert torch.get_float32_matmul_precision() == before == "highest"
        set_tf32(True, torch.device("cuda", 0))
        assert torch.get_float32_matmul_precision() == "high"
        set_tf32(False, torch.device("cuda", 0))
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_progress_bar_redraws_every_interval_and_at_the_last_batch(monkeypatch):
    drawn = []
    monkeypatch.setattr(
        RichProgressBar, "on_train_batch_end", lambda self, trainer, module, out, batch, index: drawn.append(index)
    )
    monkeypatch.setattr(TimedRichProgressBar, "total_train_batches", property(lambda self: 10))
    monkeypatch.setattr(TimedRichProgressBar, "is_disabled", property(lambda self: False))
    clock = iter([100.0, 100.0625, 100.125, 100.1875, 100.25, 100.28125, 100.3125, 100.3125, 100.3125, 100.3125])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    bar = TimedRichProgressBar(min_interval_s=0.1)
    for index in range(10):
        bar.on_train_batch_end(None, None, None, None, index)
    assert drawn == [0, 2, 4, 9]  # 0.1 s apart at least, and the epoch's last batch whenever it comes
