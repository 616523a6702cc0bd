"""Lightning's ModelParallelStrategy with checkpoint saves that a killed run cannot leave half-written."""

import os
import shutil
from pathlib import Path
from typing import Any

from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf import DictConfig
from torch import nn

from project.config.errors import ConfigError

# What Lightning's ModelParallelStrategy accepts (it refuses 16-mixed, whose gradient scaler it does not drive).
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


class ShardedCheckpointStrategy(ModelParallelStrategy):
    """Base of the strategies whose ranks each save their own part of the model (fsdp, pipeline, tensor_parallel)."""

    @classmethod
    def check_config(cls, cfg: DictConfig, net: nn.Module) -> None:
        """Rules checked before launch (``project.config.checks``); subclasses add theirs."""
        precision = _convert_precision_to_unified_args(cfg.trainer.precision)
        if precision not in SUPPORTED_PRECISIONS:
            raise ConfigError(
                "trainer.precision",
                f"is {precision!r}, which Lightning's ModelParallelStrategy (under strategy=fsdp, pipeline and "
                "tensor_parallel) does not support.",
                f"use one of {', '.join(SUPPORTED_PRECISIONS)} (bf16-mixed: parameters are gathered and computed in "
                "bf16, gradients reduced in fp32).",
            )

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        """Write into ``<name>.partial`` and swap it in only once every rank has finished.

        Lightning writes a sharded checkpoint in place, over the previous one of the same name (``last.ckpt``);
        a run killed meanwhile would leave ``last`` half old, half new. Here ``last`` is the old checkpoint until
        the new one is complete, then the new one.
        """
        final = Path(self.broadcast(str(filepath)))
        partial = final.with_name(final.name + ".partial")
        if self.global_rank == 0:
            _remove(partial)  # left over from a run killed while saving
        self.barrier()
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()
        if self.global_rank == 0:
            previous = final.with_name(final.name + ".previous")
            _remove(previous)
            if final.exists():
                os.replace(final, previous)
            os.replace(partial, final)
            _remove(previous)
        self.barrier()


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
