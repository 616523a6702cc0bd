"""Sharded (distributed) checkpoints into one ordinary Lightning checkpoint file.

``strategy=fsdp`` saves a folder: each rank's shards (``*.distcp`` + ``.metadata``, torch.distributed.checkpoint)
and Lightning's ``meta.pt`` (epoch, loops, callbacks, schedulers). Strategies that do not shard (``auto``, ``ddp``)
load single files, so such a folder is consolidated first, for evaluation or fine-tuning on any device count.
"""

import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

META_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def _optimizer_state_by_position(state: dict, parameter_names: list[str]) -> dict:
    """Sharded optimizer state is keyed by parameter name; a plain optimizer wants positions in its parameter
    list, which follows the model's parameter order (``parameter_names``).

    One parameter group is assumed, as ``configure_optimizers`` builds it. Its stored name list is the order to
    use (it names a tied weight once); a pipeline's may cover only rank 0's parameters, and then the model's
    order stands in.
    """
    (group,) = state["param_groups"]
    if set(state["state"]) <= set(group["params"]):
        parameter_names = list(group["params"])
    positions = {name: index for index, name in enumerate(parameter_names)}
    return {
        "state": {positions[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": list(range(len(parameter_names)))}],
    }


def consolidate_checkpoint(sharded_dir: str | Path, output_file: str | Path) -> Path:
    """Gather every shard of ``sharded_dir`` into full tensors and write one Lightning checkpoint file.

    Runs in one process without a process group; it needs memory for the whole model and optimizer state.
    """
    sharded_dir, output_file = Path(sharded_dir), Path(output_file)
    checkpoint = torch.load(sharded_dir / META_FILE, weights_only=False)
    with tempfile.TemporaryDirectory() as tmp:
        gathered_file = Path(tmp) / "gathered.pt"
        dcp_to_torch_save(sharded_dir, gathered_file)
        gathered = torch.load(gathered_file, weights_only=False)
    checkpoint["state_dict"] = gathered.pop("state_dict")
    parameter_names = list(checkpoint["state_dict"])  # the models keep no buffers in their state dicts
    optimizer_keys = sorted((key for key in gathered if key.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [
        _optimizer_state_by_position(gathered[key], parameter_names) for key in optimizer_keys
    ]
    output_file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, output_file)
    return output_file
