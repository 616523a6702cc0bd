"""``strategy=fsdp``: FSDP2 (``fully_shard``) through Lightning's ModelParallelStrategy.

Lightning's ``FSDPStrategy`` wraps the legacy FSDP1 and refuses CPUs; ``ModelParallelStrategy`` hosts FSDP2, runs on
CPU (gloo) as on GPU (nccl), and saves distributed checkpoints (each rank writes its own shards). This subclass
fixes its mesh to pure data parallelism over every rank and shards the model per block (``project.parallel``).
"""

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from project.parallel import apply_activation_checkpointing, apply_fsdp

# Compute dtype of the gathered parameters for each Trainer precision; None keeps the parameters' own dtype.
PARAM_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class FSDPStrategy(ModelParallelStrategy):
    """Fully sharded data parallel: parameters, gradients and optimizer state split across all ranks."""

    def __init__(
        self,
        reshard_after_forward: bool = True,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        reduce_dtype: str = "float32",
        **kwargs: Any,
    ) -> None:
        super().__init__(tensor_parallel_size=1, **kwargs)
        self.reshard_after_forward = reshard_after_forward
        self.activation_checkpointing = activation_checkpointing
        self.cpu_offload = cpu_offload
        self.reduce_dtype = getattr(torch, reduce_dtype)

    def setup_environment(self) -> None:
        # Every rank is one data-parallel shard (ModelParallelStrategy's default would use one per node).
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def parallelize(self, model: nn.Module) -> None:
        """Called from the LightningModule's ``configure_model`` with its plain model."""
        param_dtype = PARAM_DTYPES.get(self.precision_plugin.precision)
        if self.activation_checkpointing:
            apply_activation_checkpointing(model)
        apply_fsdp(
            model,
            self.device_mesh["data_parallel"],
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=param_dtype,
            reduce_dtype=self.reduce_dtype if param_dtype is not None else None,
            cpu_offload=self.cpu_offload,
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
