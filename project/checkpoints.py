"""Sharded (distributed) checkpoints into one ordinary Lightning checkpoint file.

``strategy=fsdp`` saves a folder: each rank's shards (``*.distcp`` + ``.metadata``, torch.distributed.checkpoint)
and Lightning's ``meta.pt`` (epoch, loops, callbacks, schedulers). Strategies that do not shard (``auto``, ``ddp``)
load single files, so such a folder is consolidated first, for evaluation or fine-tuning on any device count.
"""

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint


class CheckpointNotSaved(RuntimeError):
    """A checkpoint file could not be written; the run stops rather than go on without it."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Single-file checkpoints (strategies auto, ddp, model_parallel) written to ``<name>.partial`` and renamed over
    the old file once complete, so ``last.ckpt`` is always a whole checkpoint, old or new.

    Why not Lightning's own: its ``_atomic_save`` catches ``PermissionError`` and goes on, so a checkpoints dir
    that turns unwritable mid-run would lose every later checkpoint without a word. Here any failed write stops
    the run with the path and the cause. Local paths only, as this project's checkpoints dirs are.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(partial, "wb") as file:  # opened here, so that a refusal is an OSError naming its cause
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())  # on disk before it replaces the old one
            os.replace(partial, path)
        except OSError as error:
            raise CheckpointNotSaved(
                f"Could not write checkpoint {path}: {error.strerror or error} ({type(error).__name__}). Training "
                "stopped so that no later epoch goes unsaved; the checkpoints already there are intact. Make the "
                "checkpoints dir writable (or free space), then resume with ckpt_path=last."
            ) from error


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
        raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this model {len(group_names)}")
    positions = {name: position for position, name in enumerate(name for names in group_names for name in names)}
    unknown = set(state["state"]) - set(positions)
    if unknown:
        raise ValueError(f"the checkpoint has optimizer state for parameters this model lacks: {sorted(unknown)}")
    groups, start = [], 0
    for saved, names in zip(saved_groups, group_names):
        groups.append({**saved, "params": list(range(start, start + len(names)))})
        start += len(names)
    return {"state": {positions[name]: value for name, value in state["state"].items()}, "param_groups": groups}


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
    optimizer_keys = sorted((key for key in gathered if key.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_optimizer_state_by_position(gathered[key], group_names) for key in optimizer_keys]
    output_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, output_file)
    return output_file
