"""What the strategies whose ranks each hold a part of the model share (fsdp, pipeline, tensor_parallel):
``ShardedStrategy``, Lightning's ModelParallelStrategy on the mesh of the strategy's layout (``ShardedLayout``), each
rank laying out its own part of the plain (meta) model, with checkpoint saves that a killed run cannot leave
half-written."""

from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.model_parallel import _load_raw_module_state
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.utils._pytree import tree_leaves

from project.accounting.memory_trackers import local_bytes
from project.checkpointing.background import CheckpointWriter, staged_copy_fits, swap_in
from project.checkpointing.files import CHECKPOINT_NOT_SAVED, META_FILE, optimizer_state_by_name
from project.job.layout import TaskModule
from project.layouts.sharded_layout import ShardedLayout
from project.models.sequence import BlockSequence
from project.options.writes import full_disk, os_error, remove, write_failed
from project.strategies.laid_out import LaidOutStrategy


class ShardedStrategy(ModelParallelStrategy, LaidOutStrategy):
    """Lightning's ModelParallelStrategy on the device mesh of ``layout``, which lays out this rank's part of the
    model (``ShardedLayout.lay_out``); ``kwargs`` are ModelParallelStrategy's (process group backend, timeout...)."""

    layout: ShardedLayout

    def __init__(self, layout: ShardedLayout, **kwargs: Any) -> None:
        super().__init__(tensor_parallel_size=layout.tensor_parallel.size, **kwargs)
        self.layout = layout
        # Checkpoints written in the background: the checkpoint callback's async_save (LatestAndBestCheckpoint).
        self.async_save = False
        self.checkpoint_writer = CheckpointWriter()

    def setup_environment(self) -> None:
        # ModelParallelStrategy's, on this strategy's mesh (Lightning's own is (data_parallel, tensor_parallel) with
        # one data-parallel replica per node).
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()
        self._device_mesh = self.layout.dims(self.world_size).build_mesh(self.root_device.type)
        assert self.lightning_module is not None  # (as in Lightning's own setup_environment)
        self.lightning_module._device_mesh = self._device_mesh

    def parallelize(self, model: BlockSequence) -> None:
        self.layout.lay_out(model, self.device_mesh, self.precision_plugin.precision)

    def clip_grad_norm_(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor | None:
        return None  # Lightning's: the norm of DTensor gradients adds up over their mesh

    @property
    def parameter_stage(self) -> dict[int, int]:
        return {}

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        # The loss of vocabulary-split logits has its own backward, which torch runs only inside loss_parallel.
        with self.layout.tensor_parallel.loss_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's, and a one-file checkpoint (auto, ddp, model_parallel saved it) besides: its model state
        scattered to this layout, its optimizer state keyed by parameter name through the optimizer's groups
        (``optimizer_state_by_name``; Lightning's own keying assumed the module's order and failed on shapes)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir():
            return super().load_checkpoint(path, weights_only)
        assert self.model is not None and self.lightning_module is not None  # (as in Lightning's own)
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=bool(weights_only))
        strict = self.lightning_module.strict_loading
        _load_raw_module_state(checkpoint.pop("state_dict"), self.model, strict=strict)
        options = StateDictOptions(broadcast_from_rank0=True, full_state_dict=True, strict=strict)
        group_names = cast(TaskModule, self.lightning_module).parameter_groups()
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            by_name = optimizer_state_by_name(state, group_names)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=by_name, options=options)
        return checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        """Write into ``<name>.partial`` and swap it in only once every rank has finished; in the background where
        ``async_save`` (``project.checkpointing.background``), else before training goes on.

        Lightning writes a sharded checkpoint in place, over the previous one of the same name (``last.ckpt``);
        a run killed meanwhile would leave ``last`` half old, half new. Here ``last`` is the old checkpoint until
        the new one is complete, then the new one. A write that fails (a full disk) removes the partial dir and
        stops the run with the path and the cause (``WriteFailed``).
        """
        final = Path(self.broadcast(str(filepath)))
        partial = final.with_name(final.name + ".partial")
        self.finish_checkpoint_writes(before=final)
        if self.global_rank == 0:
            remove(partial)  # left over from a run killed while saving
        self.barrier()
        background = self._writes_in_background(checkpoint)
        sharded = background or (self._save_distributed_checkpoint and storage_options is None)
        if sharded:  # Lightning's sharded checkpoint (its meta.pt: the loops, callbacks, schedules; by rank 0)
            state = {"state_dict": checkpoint.pop("state_dict")}
            state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
            if self.global_rank == 0:
                partial.mkdir(parents=True, exist_ok=True)  # (the other ranks may have made it already)
                torch.save(checkpoint, partial / META_FILE)
        if background:
            self.checkpoint_writer.start(state, partial, final, self.global_rank)
            return
        try:
            if sharded:  # no_dist (see CheckpointWriter.start): the files are the same
                dcp.save(state, checkpoint_id=partial, no_dist=self.world_size == 1)
            else:  # one full file, or Lightning's error for storage options
                super().save_checkpoint(checkpoint, partial, storage_options)
        except (Exception, CheckpointException) as error:  # DCP's gathers every rank's failures, its own base class
            failure = self._write_failed(error, partial, final)
            if failure is error:
                raise
            raise failure from error
        self.barrier()
        if self.global_rank == 0:
            swap_in(partial, final)
        self.barrier()

    def finish_checkpoint_writes(self, before: Path | None = None) -> None:
        """Wait for the checkpoint being written in the background, if any, and stop the run if it failed. Every rank
        calls it together: before the next save (``before``), and when training ends."""
        pending = self.checkpoint_writer.pending
        try:
            self.checkpoint_writer.finish(before)
        except (Exception, CheckpointException) as error:
            assert pending is not None
            failure = self._write_failed(error, pending.partial, pending.final)
            if failure is error:
                raise
            raise failure from error

    def _writes_in_background(self, checkpoint: dict[str, Any]) -> bool:
        """``async_save`` for a distributed checkpoint, unless this node's ranks' copies of their shards would not
        fit in host memory (then, once a run, the log says so, and the checkpoints are written synchronously)."""
        if not (self.async_save and self._save_distributed_checkpoint):  # (else one full file, written by rank 0)
            return False
        tensors = tree_leaves([checkpoint["state_dict"], checkpoint.get("optimizer_states")])
        state_bytes = sum(local_bytes(t) for t in tensors if isinstance(t, torch.Tensor))
        fits = staged_copy_fits(state_bytes, self.num_processes)
        if not self.reduce_boolean_decision(fits, all=True):  # every rank decides alike
            rank_zero_warn(
                f"callbacks.model_checkpoint.async_save: a copy of each rank's checkpoint ({state_bytes / 2**30:.1f} "
                "GiB) would not fit in half this node's free host memory; checkpoints are written synchronously."
            )
            self.async_save = False
        return self.async_save

    def _write_failed(self, error: BaseException, partial: Path, final: Path) -> BaseException:
        """The error a failed write stops the run with: ``WriteFailed`` naming the file and the cause where an
        ``OSError`` caused it (a full disk), else ``error``; the partial dir is removed on every rank."""
        cause = _os_error(error) or full_disk(partial)
        if isinstance(error, CheckpointException):
            self.barrier()  # DCP raised it on every rank: each has seen the full disk before any frees it
        remove(partial)  # on every rank: whichever does it first frees the space
        return error if cause is None else write_failed(final, "checkpoint", cause, CHECKPOINT_NOT_SAVED)

    def teardown(self) -> None:
        self.checkpoint_writer.close()
        super().teardown()


def _os_error(error: BaseException) -> OSError | None:
    """The ``OSError`` behind ``error``: in its chain, or, for DCP's ``CheckpointException``, any rank's."""
    if isinstance(error, CheckpointException):
        return next((os_error(cause) for cause, _ in error.failures.values() if os_error(cause)), None)
    return os_error(error)
