"""A launch resolves its config once (``project.launch.resolution``), and checkpoints outlive the code's layout: one
written before the move to the staged ``project/`` (``tests/data/old_layout``, saved by commit 54adea1) resumes
exactly."""

import json
import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, assert_close, isolated_env
from omegaconf import OmegaConf

from project.checkpointing.files import job_config

OLD = REPO / "tests" / "data" / "old_layout"  # epoch 0 of a 2-epoch run, its config and result, by the old layout
COUNTED = [
    "project.config.checks:check_config",
    "project.config.checks:resolve_ckpt_path",
    "project.plan.memory_plan:plan_memory",
]


def pickled_globals(checkpoint: Path) -> set[str]:
    """The classes and functions a torch.save file's pickle names (``module name``), read without unpickling."""
    with zipfile.ZipFile(checkpoint) as archive:
        pickle = archive.read(next(name for name in archive.namelist() if name.endswith("data.pkl")))
    found, strings = set(), []
    for opcode, argument, _ in pickletools.genops(pickle):
        if opcode.name == "GLOBAL":
            found.add(argument)
        elif isinstance(argument, str):
            strings.append(argument)
        elif opcode.name == "STACK_GLOBAL":  # module and name were the two strings pushed last
            found.add(" ".join(strings[-2:]))
    return found


@pytest.fixture(scope="module")
def resumed_old_checkpoint(tmp_path_factory, home) -> tuple[Path, dict[str, int]]:
    """The old layout's epoch 0 resumed for epoch 1 by today's code, in this process's own ``train.py`` run with
    every call of the counted functions counted."""
    job_dir, counts = tmp_path_factory.mktemp("resumed") / "job", tmp_path_factory.mktemp("counts") / "counts.json"
    overrides = [line for line in yaml.safe_load((OLD / "overrides.yaml").read_text())]
    command = [
        sys.executable,
        "tests/helpers/count_calls.py",
        str(counts),
        *COUNTED,
        "--",
        *overrides,
        f"ckpt_path={OLD / 'epoch000.ckpt'}",
        f"hydra.run.dir={job_dir}",
    ]
    result = subprocess.run(command, cwd=REPO, env=isolated_env(home), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return job_dir, json.loads(counts.read_text())


def test_each_check_and_the_memory_plan_run_once_per_launch(resumed_old_checkpoint):
    _, counts = resumed_old_checkpoint
    assert counts == {name: 1 for name in COUNTED}


def test_a_checkpoint_of_the_old_layout_resumes_exactly(resumed_old_checkpoint):
    """Epoch 1 resumed by today's code is the old code's own uninterrupted epoch 1."""
    job_dir, _ = resumed_old_checkpoint
    old = json.loads((OLD / "result.json").read_text())["history"]
    resumed = json.loads((job_dir / "result.json").read_text())["history"]
    assert [row["epoch"] for row in resumed] == [0, 1]
    for key in ("train/loss", "val/loss"):
        assert_close([resumed[1][key]], [old[1][key]], rel=1e-6)


def test_checkpoints_pickle_no_classes_of_this_project(resumed_old_checkpoint):
    """Only torch's tensor storage and plain containers: moving a module can break no checkpoint."""
    job_dir, _ = resumed_old_checkpoint
    for checkpoint in (OLD / "epoch000.ckpt", job_dir / "checkpoints" / "last.ckpt"):
        names = pickled_globals(checkpoint)
        assert names and all(name.split()[0] in ("torch", "torch._utils", "collections") for name in names), names


def test_the_old_layout_job_dir_exports_and_its_moved_targets_are_rewritten(tmp_path, home):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "project.cli.export",
            str(OLD / "epoch000.ckpt"),
            str(tmp_path / "hf"),
            "--config",
            str(OLD / "config.yaml"),
        ],
        cwd=REPO,
        env=isolated_env(home),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    old_shards = OmegaConf.load(OLD / "config.yaml")
    old_shards.data = {"_target_": "project.data.prepared.ShardsDataModule", "path": "corpus"}
    OmegaConf.save(old_shards, tmp_path / "config.yaml")
    assert (
        job_config(OLD / "epoch000.ckpt", tmp_path / "config.yaml").data._target_
        == "project.data.shards.ShardsDataModule"
    )
