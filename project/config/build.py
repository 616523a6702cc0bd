"""The objects a config names, built as the workers build them: the plain model on the meta device and the
Lightning strategy."""

from typing import Any, cast

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from project.distributed.dims import ParallelDims


def build_net(cfg: DictConfig) -> torch.nn.Module:
    """The plain model on the meta device: shapes only, no memory. Each rank materialises only what it keeps,
    once the strategy has sharded or split it (``TrainingModule.configure_model``)."""
    with torch.device("meta"):
        return instantiate(cfg.model.net)


# The strategy group's options that the launcher reads, not the strategy class.
LAUNCHER_KEYS = ("processes", "heartbeat_timeout")


def build_strategy(strategy_cfg: DictConfig) -> Any:
    """The Lightning strategy of the ``strategy`` group: its ``_target_`` built with every option but the
    launcher's, or Lightning's own ``"auto"`` where the option names no class."""
    if "_target_" not in strategy_cfg:
        return "auto"
    keys = cast(list[str], [key for key in strategy_cfg if key not in LAUNCHER_KEYS])  # a group's keys are strings
    return instantiate(OmegaConf.masked_copy(strategy_cfg, keys))


def parallel_dims(strategy: Any, world_size: int) -> ParallelDims:
    """How ``world_size`` ranks divide under ``strategy`` (a built one): its own ``dims``, or for Lightning's
    (auto, DDP, one device) every rank a data-parallel replica holding the whole model."""
    dims = getattr(strategy, "dims", None)
    return dims(world_size) if dims is not None else ParallelDims(world_size)
