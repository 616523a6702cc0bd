"""Faults: what happens to checkpoints, workers and job dirs when something goes wrong."""

import torch

from conftest import TINY, train
from probes import thaw


def saved_epoch(path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["epoch"]


def test_last_is_the_latest_epoch_when_the_metric_gets_worse(home, tmp_path):
    """Monitoring the step count with mode=min makes every epoch after the first worse than the best."""
    job_dir = tmp_path / "job"
    train([*TINY, f"hydra.run.dir={job_dir}", "logger=csv", "callbacks.model_checkpoint.monitor=step",
           "callbacks.model_checkpoint.mode=min"], home)
    checkpoints = job_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["epoch000.ckpt", "last.ckpt"]
    assert saved_epoch(checkpoints / "epoch000.ckpt") == 0  # the best stays the first epoch...
    assert saved_epoch(checkpoints / "last.ckpt") == 2  # ...and last is the third of 3


def test_an_unwritable_checkpoints_dir_stops_the_run(home, tmp_path):
    """The dir turns unwritable when epoch 1 starts; saving epoch 1 must fail the run, naming the path and cause."""
    job_dir = tmp_path / "job"
    checkpoints = job_dir / "checkpoints"
    try:
        result = train([*TINY, f"hydra.run.dir={job_dir}", "logger=csv", "callbacks.model_checkpoint.save_top_k=-1",
                        "+callbacks.freeze._target_=probes.FreezeCheckpointsDir", "+callbacks.freeze.epoch=1"],
                       home, expect_ok=False)
    finally:
        if checkpoints.exists():
            thaw(checkpoints)
    assert result.returncode != 0
    assert f"Could not write checkpoint {checkpoints}/epoch001.ckpt: Operation not permitted" in result.output or (
        f"Could not write checkpoint {checkpoints}/epoch001.ckpt: Permission denied" in result.output), result.output[-3000:]
    # What was saved before is whole: epoch 0, as best and as last.
    assert sorted(path.name for path in checkpoints.iterdir()) == ["epoch000.ckpt", "last.ckpt"]
    assert saved_epoch(checkpoints / "last.ckpt") == 0
