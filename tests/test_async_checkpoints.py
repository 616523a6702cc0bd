"""Distributed checkpoints written in the background (``callbacks.model_checkpoint.async_save``,
project/checkpointing/background.py): what a background write saves against a synchronous one of the same step, and
a run killed in the middle of one against a run never stopped. (A write that fails, a full disk: test_faults.)"""

import json
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import TINY, PreloadedRun, shared_run, train
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from project.checkpointing.background import staged_copy_fits
from project.checkpointing.files import checkpoint_meta

pytestmark = pytest.mark.torch_internals

FSDP = [*TINY, "strategy=fsdp", "trainer.devices=2", "logger=csv", "trainer.max_epochs=2"]
SLOW = ["+callbacks.slow._target_=helpers.probes.SlowCheckpointWrites", "+callbacks.slow.seconds=0.5"]
# Every epoch's checkpoint kept, and no last.ckpt: each epoch's save is written while the next epoch trains.
EVERY_EPOCH = ["callbacks.model_checkpoint.save_top_k=-1", "callbacks.model_checkpoint.save_last=false"]


def history_of(job_dir: Path) -> list[dict]:
    """Each epoch's logged numbers (result.json), without the run's clock."""
    history = json.loads((job_dir / "result.json").read_text())["history"]
    return [{key: value for key, value in epoch.items() if not key.startswith("perf/")} for epoch in history]


@pytest.fixture(scope="module")
def written_both_ways(runs_dir, home) -> dict[bool, Path]:
    """The fsdp x 2 MLP for 2 epochs, each rank's writes half a second late, with ``async_save`` true and false."""
    dirs = {flag: runs_dir / f"async-save-{flag}" for flag in (True, False)}
    for flag, job_dir in dirs.items():
        args = [*FSDP, *SLOW, *EVERY_EPOCH, f"callbacks.model_checkpoint.async_save={flag}", f"hydra.run.dir={job_dir}"]
        shared_run(runs_dir, job_dir.name, lambda args=args: train(args, home).output)
    return dirs


def everything_saved(checkpoint: Path) -> dict:
    """Every tensor and value of a distributed checkpoint (model and optimizer state), gathered whole."""
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(checkpoint, Path(tmp) / "all.pt")
        return torch.load(Path(tmp) / "all.pt", weights_only=False)


def assert_identical(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, where


@pytest.mark.slow
def test_a_checkpoint_written_in_the_background_is_the_synchronous_one_bit_for_bit(written_both_ways):
    """Each epoch's checkpoint, written while the next epoch trains (its shards copied to host memory first), holds
    exactly the tensors of the one written before training went on: the model and the optimizer state."""
    names = sorted(path.name for path in (written_both_ways[False] / "checkpoints").iterdir())
    assert names == ["epoch000.ckpt", "epoch001.ckpt"]
    assert sorted(path.name for path in (written_both_ways[True] / "checkpoints").iterdir()) == names
    for name in names:
        background, synchronous = (
            everything_saved(written_both_ways[flag] / "checkpoints" / name) for flag in (True, False)
        )
        assert any(key.startswith("optimizer_") for key in background)
        assert_identical(background, synchronous, name)
    assert history_of(written_both_ways[True]) == history_of(written_both_ways[False])


@pytest.mark.slow
def test_a_run_killed_in_the_middle_of_a_background_write_resumes_exactly_from_the_previous_checkpoint(
    written_both_ways, tmp_path, home
):
    """SIGKILL on every rank while epoch 1's last.ckpt is written in the background (its shards on disk, not its
    metadata): last.ckpt is still epoch 0's, whole; ckpt_path=last says so and resumes from it, and epoch 1
    come out as the run that was never stopped had it. Before that, each epoch's last.ckpt waited for its best
    checkpoint's write, and the log says so."""
    job_dir = tmp_path / "killed"
    # 3 epochs: epoch 2 waits at its start for the kill (SlowCheckpointWrites); the MLP's SGD has no schedule, so its
    # epoch 1 is the 2-epoch run's. Its workers are started from scratch, as a user's are: the test harness's forked
    # ones (tests/helpers/preloaded.py) stand in for a worker but not for one that kills itself.
    run = [*FSDP, *SLOW, "trainer.max_epochs=3", f"hydra.run.dir={job_dir}"]
    killed = PreloadedRun([*run, "+callbacks.slow.kill=2"], home, fresh_workers=True)
    assert killed.wait(timeout=300) != 0
    checkpoints = job_dir / "checkpoints"
    assert checkpoint_meta(checkpoints / "last.ckpt")["epoch"] == 0
    partial = checkpoints / "last.ckpt.partial"
    assert list(partial.glob("*.distcp")) and not (partial / ".metadata").exists()
    log = (job_dir / "train.log").read_text()
    assert "Checkpoint epoch000.ckpt is still being written; last.ckpt waits for it." in log
    resuming = train([*run, "ckpt_path=last"], home)
    assert f"{partial} is a checkpoint whose write was cut short" in resuming.output
    resumed, straight = history_of(job_dir), history_of(written_both_ways[False])
    assert [epoch["epoch"] for epoch in resumed] == [0, 1, 2]
    assert resumed[1] == straight[1]


def test_a_copy_is_staged_only_where_half_the_available_host_memory_holds_every_ranks():
    """The shards' copies of a node's ranks must fit in half of Linux's MemAvailable, read here on its own."""
    available = next(
        int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines() if "MemAvailable" in line
    )
    assert staged_copy_fits(available // 8, ranks_on_node=2)
    assert not staged_copy_fits(available // 2, ranks_on_node=2)
