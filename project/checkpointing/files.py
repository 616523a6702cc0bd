"""Sharded (distributed) checkpoints into one ordinary Lightning checkpoint file.

``strategy=fsdp`` saves a folder: each rank's shards (``*.distcp`` + ``.metadata``, torch.distributed.checkpoint)
and Lightning's ``meta.pt`` (epoch, loops, callbacks, schedulers). Strategies that do not shard (``auto``, ``ddp``)
load single files, so such a folder is consolidated first, for evaluation or fine-tuning on any device count.
"""

import os
import pickle
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any, cast

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load

from project.options.writes import written

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint


# What a checkpoint that cannot be written stops the run with, after the path and the cause.
CHECKPOINT_NOT_SAVED = (
    "Training stopped so that no later epoch goes unsaved; the checkpoints already there are intact. Free space on "
    "that disk (or make the checkpoints dir writable), then resume with ckpt_path=auto."
)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Single-file checkpoints (strategies auto, ddp, model_parallel) written to ``<name>.partial`` and renamed over
    the old file once complete, so ``last.ckpt`` is always a whole checkpoint, old or new.

    Why not Lightning's own: its ``_atomic_save`` catches ``PermissionError`` and goes on, so a checkpoints dir
    that turns unwritable mid-run would lose every later checkpoint without a word. Here any failed write (a full
    disk included) removes the partial file and stops the run with the path and the cause (``WriteFailed``). Local
    paths only, as this project's checkpoints dirs are.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        # Opened here, so that a refusal is an OSError naming its cause.
        with written(path, "checkpoint", CHECKPOINT_NOT_SAVED) as partial, open(partial, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())  # on disk before it replaces the old one


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def _optimizer_state_by_position(state: dict, group_names: list[list[str]]) -> dict:
    """Sharded optimizer state is keyed by parameter name; a plain optimizer wants positions: a parameter's place
    in its group list, groups one after the other. ``group_names`` names the parameters of each group of the
    optimizer that will load the file (``TrainingModule.parameter_groups``), so every parameter's state lands on
    its own parameter, whichever rank saved it. The groups' settings are those saved (rank 0's; all ranks have the
    same groups).
    """
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(group_names):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this model {len(group_names)}"
        )
    positions = {name: position for position, name in enumerate(name for names in group_names for name in names)}
    unknown = set(state["state"]) - set(positions)
    if unknown:
        raise ValueError(f"the checkpoint has optimizer state for parameters this model lacks: {sorted(unknown)}")
    groups, start = [], 0
    for saved, names in zip(saved_groups, group_names):
        groups.append({**saved, "params": list(range(start, start + len(names)))})
        start += len(names)
    return {"state": {positions[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(state: dict, group_names: list[list[str]]) -> dict:
    """A plain optimizer's state (by position: a parameter's place in its group list, groups one after the other)
    keyed by parameter name instead, ``group_names`` naming each group's parameters in order
    (``TrainingModule.parameter_groups``): what a sharded strategy loads from a one-file checkpoint. (Lightning would
    key it by the module's parameter order, which is not the groups' when weight decay spares some.)"""
    names = [name for group in group_names for name in group]
    if len(names) < len(state["state"]) or any(position >= len(names) for position in state["state"]):
        raise ValueError(
            f"the checkpoint's optimizer has state for {len(state['state'])} parameters, this model {len(names)}"
        )
    groups = [{**saved, "params": list(group)} for saved, group in zip(state["param_groups"], group_names)]
    return {"state": {names[position]: value for position, value in state["state"].items()}, "param_groups": groups}


def consolidate_checkpoint(sharded_dir: str | Path, output_file: str | Path, group_names: list[list[str]]) -> Path:
    """Gather every shard of ``sharded_dir`` into full tensors and write one Lightning checkpoint file, with the
    optimizer state laid out for an optimizer whose groups hold the parameters ``group_names`` names.

    Runs in one process without a process group; it needs memory for the whole model and optimizer state.
    """
    sharded_dir, output_file = Path(sharded_dir), Path(output_file)
    checkpoint = torch.load(sharded_dir / META_FILE, weights_only=False)
    with tempfile.TemporaryDirectory() as tmp:
        gathered_file = Path(tmp) / "gathered.pt"
        dcp_to_torch_save(sharded_dir, gathered_file)
        gathered = torch.load(gathered_file, weights_only=False)
    checkpoint["state_dict"] = gathered.pop("state_dict")
    optimizer_keys = sorted(
        (key for key in gathered if key.startswith("optimizer_")), key=lambda k: int(k.split("_")[1])
    )
    checkpoint["optimizer_states"] = [
        _optimizer_state_by_position(gathered[key], group_names) for key in optimizer_keys
    ]
    output_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, output_file)
    return output_file


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """The parameter names and shapes a Lightning checkpoint holds, read without loading its tensors: a sharded
    checkpoint's metadata, or a file's index (memory-mapped). ``ValueError`` saying what ``path`` is instead."""
    path = Path(path)
    if path.is_dir():
        if not is_sharded_checkpoint(path):
            raise ValueError(f"is a directory, not a sharded checkpoint (one holds {META_FILE} and .metadata)")
        metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        prefix = "state_dict."
        tensors = cast(dict[str, TensorStorageMetadata], metadata)  # the state_dict's entries are tensors'
        return {key.removeprefix(prefix): tuple(item.size) for key, item in tensors.items() if key.startswith(prefix)}
    if not zipfile.is_zipfile(path):
        raise ValueError("is not a checkpoint file (torch.save's format)")
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (
        pickle.UnpicklingError
    ):  # objects beyond tensors and plain containers: the user's own file, as Lightning reads it
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise ValueError("holds no state_dict: it is not a Lightning checkpoint")
    return {name: tuple(tensor.shape) for name, tensor in checkpoint["state_dict"].items()}


PREFIX = "net."  # the LightningModule's name for the model in its state_dict


def model_state(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The model's tensors of a checkpoint, by parameter name (sharded ones gathered whole)."""
    checkpoint = Path(checkpoint)
    if is_sharded_checkpoint(checkpoint):
        metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
        tensors = cast(dict[str, TensorStorageMetadata], metadata)  # the model's entries are tensors'
        wanted = {
            key: torch.empty(item.size, dtype=item.properties.dtype)
            for key, item in tensors.items()
            if key.startswith(f"state_dict.{PREFIX}")
        }
        with warnings.catch_warnings():  # one process reading on purpose, which DCP warns about
            warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")
            load(wanted, checkpoint_id=str(checkpoint), no_dist=True)
        return {key.removeprefix(f"state_dict.{PREFIX}"): value for key, value in wanted.items()}
    state = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=False)
    if not isinstance(state, dict) or "state_dict" not in state:
        raise ValueError(f"{checkpoint} is not a Lightning checkpoint (no state_dict)")
    state = state["state_dict"]
    return {key.removeprefix(PREFIX): value for key, value in state.items() if key.startswith(PREFIX)}


# Classes that moved since jobs saved their config.yaml, by the path those configs name (``data`` and ``model.net``,
# which export and generate build, kept their paths but for this one).
MOVED_TARGETS = {"project.data.prepared.ShardsDataModule": "project.data.shards.ShardsDataModule"}


def checkpoint_meta(checkpoint: str | Path) -> dict[str, Any]:
    """What a checkpoint holds beside the tensors of the model and optimizer: a sharded one's ``meta.pt``, or the
    file's dict less those (memory-mapped: the tensors are not read)."""
    path = Path(checkpoint)
    if is_sharded_checkpoint(path):
        return torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    return {key: value for key, value in saved.items() if key not in ("state_dict", "optimizer_states")}


def job_config_file(checkpoint: str | Path, config: str | Path | None = None) -> Path:
    """``config``, or the ``config.yaml`` of the job dir whose ``checkpoints/`` holds ``checkpoint``."""
    return Path(config) if config else Path(checkpoint).resolve().parent.parent / "config.yaml"


def job_config(checkpoint: str | Path, config: str | Path | None = None) -> DictConfig:
    """The resolved config of the job that saved ``checkpoint``: ``config``, or the job dir's ``config.yaml``
    beside its ``checkpoints/``, with the data and model classes at their current paths."""
    config = job_config_file(checkpoint, config)
    if not config.is_file():
        raise FileNotFoundError(f"{config} does not exist: pass the job's config with --config <job dir>/config.yaml")
    cfg = cast(DictConfig, OmegaConf.load(config))  # a job's config: a mapping
    for node in (cfg.get("data"), OmegaConf.select(cfg, "model.net")):
        if node is not None and node.get("_target_") in MOVED_TARGETS:
            node._target_ = MOVED_TARGETS[node._target_]
    return cfg
