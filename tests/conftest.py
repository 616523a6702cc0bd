"""Shared helpers: run ``python train.py`` (or torchrun) as a user would, in an isolated HOME, and find its outputs."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from wandb_offline import OfflineRun, offline_runs

REPO = Path(__file__).resolve().parents[1]

# A model and data small enough for a few seconds per run; everything else is the real default config.
TINY = [
    "data.num_features=32",
    "data.num_train=1024",
    "data.num_val=250",  # not a multiple of any global batch: exercises the uneven evaluation split
    "model.net.hidden_dims=[64,32]",
    "model.optimizer.lr=0.1",
    "trainer.max_epochs=3",
    "print_config=false",
    "~callbacks.progress_bar",
    "+trainer.enable_progress_bar=false",
]


def isolated_env(home: Path) -> dict[str, str]:
    """No W&B credentials or mode from the developer's machine: runs must decide offline by themselves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), PYTHONUNBUFFERED="1")
    return env


def run_command(command: list[str], home: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(
        command, cwd=REPO, env=isolated_env(home), capture_output=True, text=True, timeout=timeout
    )
    result.output = result.stdout + result.stderr
    return result


def train(args: list[str], home: Path, expect_ok: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python train.py <args>``; fails the test with the output if it did not exit 0 (and expect_ok)."""
    result = run_command([sys.executable, "train.py", *args], home, timeout)
    if expect_ok:
        assert result.returncode == 0, result.output[-6000:]
    return result


def torchrun(nproc: int, args: list[str], home: Path) -> subprocess.CompletedProcess:
    torchrun_bin = str(Path(sys.executable).with_name("torchrun"))
    result = run_command([torchrun_bin, "--standalone", f"--nproc-per-node={nproc}", "train.py", *args], home)
    assert result.returncode == 0, result.output[-6000:]
    return result


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="session")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


# The per-epoch results that must not depend on how a run is parallelised.
LOSS_KEYS = ["train/loss", "val/loss", "train/acc", "val/acc"]

# Logged once per epoch by every run.
EPOCH_KEYS = [
    "train/loss",
    "train/acc",
    "val/loss",
    "val/acc",
    "perf/samples_per_sec",
    "perf/epoch_time_s",
    "memory/params_mb",
    "memory/grads_mb",
    "memory/optimizer_mb",
    "memory/model_state_mb",
]


def only_run(job_dir) -> OfflineRun:
    runs = offline_runs(job_dir)
    assert len(runs) == 1, f"expected one W&B run in {job_dir}, found {len(runs)}"
    return runs[0]


def assert_close(a: list[float], b: list[float], rel: float) -> None:
    assert len(a) == len(b) and a, (a, b)
    for x, y in zip(a, b):
        assert math.isclose(x, y, rel_tol=rel), (a, b)


def assert_epoch_metrics(run: OfflineRun, epochs: int) -> None:
    """Each key logged once per epoch, against `epoch` 0..epochs-1."""
    for key in EPOCH_KEYS:
        rows = [row for row in run.history if key in row]
        assert [row["epoch"] for row in rows] == list(range(epochs)), key


@pytest.fixture(scope="session")
def single_run(runs_dir, home):
    """auto on one device, global batch 64."""
    job_dir = runs_dir / "single"
    train([*TINY, f"hydra.run.dir={job_dir}", "data.batch_size=64"], home)
    return job_dir
