"""Callbacks the tests add to real runs (``+callbacks.<name>._target_=helpers.probes.<Class>``) to see inside the
workers;
each logs what it saw as per-epoch ``probe/*`` metrics, which the tests read back from the W&B run."""

import atexit
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist


class BackwardHooks(L.Callback):
    """Counts Lightning's ``on_before_backward`` / ``on_after_backward`` calls of each epoch, and the share of this
    rank's parameters that have a gradient when ``on_after_backward`` runs (min over ranks)."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.before = self.after = 0
        self.with_grad: list[float] = []

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss) -> None:
        self.before += 1

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.after += 1
        parameters = list(pl_module.parameters())
        self.with_grad.append(sum(p.grad is not None for p in parameters) / len(parameters))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.log("probe/before_backward", float(self.before), sync_dist=True, reduce_fx="min")
        pl_module.log("probe/after_backward", float(self.after), sync_dist=True, reduce_fx="min")
        pl_module.log("probe/params_with_grad", min(self.with_grad), sync_dist=True, reduce_fx="min")


class AllGatherCount(L.Callback):
    """Counts the all-gathers (FSDP gathering parameters) of each training batch; logs the epoch's median per
    batch, max over ranks."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.count = 0
        # FSDP2 gathers through dist.all_gather_single from torch 2.13 on, through all_gather_into_tensor before.
        name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        gather = getattr(dist, name)

        def counted(*args, **kwargs):
            self.count += 1
            return gather(*args, **kwargs)

        setattr(dist, name, counted)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.per_batch: list[int] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self.at_start = self.count

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.per_batch.append(self.count - self.at_start)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        median = float(statistics.median(self.per_batch))
        pl_module.log("probe/all_gathers_per_batch", median, sync_dist=True, reduce_fx="max")


class FreezeCheckpointsDir(L.Callback):
    """Makes the checkpoints dir unwritable when epoch ``epoch`` starts (0-based): immutable for root, whom file
    modes do not stop, read-only otherwise. The test undoes it (``thaw``)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch and trainer.is_global_zero:
            freeze(Path(trainer.checkpoint_callback.dirpath))


def freeze(directory: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(directory)], check=True)
    else:
        directory.chmod(0o555)


def thaw(directory: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(directory)], check=True)
    else:
        directory.chmod(0o755)


class SlowEpochs(L.Callback):
    """Sleeps ``seconds`` at the end of every training epoch, so that a test can signal a job between epochs;
    the numbers do not change."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        time.sleep(self.seconds)


class StallAtStep(L.Callback):
    """Rank 0 stops at optimizer step ``step`` (its peers then wait in their next collective) and creates the file
    ``marker``, so that the test can kill the run at a known point."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, Path(marker)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            self.marker.touch()
            time.sleep(600)


class PoisonWeights(L.Callback):
    """Rank ``rank`` fills its first parameter with NaN before optimizer step ``step`` + 1: its training loss of
    that batch is NaN, the other ranks' finite (a divergence that starts on one rank)."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))


class PoisonGradients(L.Callback):
    """Rank ``rank`` puts an infinite gradient into its first parameter before optimizer step ``step`` + 1 (after
    backward, before clipping): the batch's loss is finite on every rank, its gradient norm infinite on one."""

    def __init__(self, step: int, rank: int) -> None:
        self.step, self.rank = step, rank

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            next(pl_module.parameters()).grad.view(-1)[0] = float("inf")


class FailInFit(L.Callback):
    """Raises on every rank as training starts: a failure inside the workers, past every check before launch.

    Each rank then holds its exit until every rank's torchelastic error file exists: the agent stops the others
    as soon as one worker exits, so without the hold a rank slowed down by a busy machine would be stopped before
    it raised, and the launcher's report would rightly not list it."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        own = Path(os.environ["TORCHELASTIC_ERROR_FILE"])  # <attempt dir>/<local rank>/error.json
        error_files = [own.parent.parent / str(rank) / own.name for rank in range(int(os.environ["LOCAL_WORLD_SIZE"]))]
        atexit.register(self._wait_for, error_files)  # runs after @record wrote this rank's file
        raise ValueError(f"a failure in fit, on rank {trainer.global_rank}")

    @staticmethod
    def _wait_for(paths: list[Path], bound_s: float = 100.0) -> None:
        """Wait until every path exists; the bound is a safety net under the test's own timeout, not a verdict."""
        deadline = time.monotonic() + bound_s
        while not all(path.exists() for path in paths) and time.monotonic() < deadline:
            time.sleep(0.05)


class FusedAdamW(L.Callback):
    """Logs ``probe/fused_adamw_on_cuda``: 1 when every optimizer of the run is an AdamW with ``fused=True`` over
    parameters on CUDA, the kernel the config asks for on a GPU."""

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        fused = all(
            isinstance(optimizer, torch.optim.AdamW)
            and optimizer.defaults.get("fused")
            and all(p.is_cuda for group in optimizer.param_groups for p in group["params"])
            for optimizer in trainer.optimizers
        )
        pl_module.log("probe/fused_adamw_on_cuda", float(fused))


class CollectiveBytesPerBatch(L.Callback):
    """Counts the collectives of each training batch's step on every rank, with the memory plan's own counter
    (``project.accounting.counts.StepCounts``) over this run's real process group: those of the strategy's
    ``training_step`` and ``backward`` (forward and backward, a pipeline's schedule), not the other callbacks'
    (the memory callback measures the model state with collectives of its own). Each rank writes every batch's
    epoch, index in the epoch and bytes by link (kind, mesh dimension, ranks, nodes) to
    ``<job dir>/collectives_rank<R>.json``."""

    def __init__(self) -> None:
        self.batches: list[dict] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from project.accounting.counts import StepCounts
        from project.parallel.dims import DATA_PARALLEL
        from project.strategies.laid_out import LaidOutStrategy

        strategy = trainer.strategy
        laid_out = isinstance(strategy, LaidOutStrategy)  # Lightning's DDP: every rank a replica
        world_dim = strategy.layout.dims(trainer.world_size).world_dim if laid_out else DATA_PARALLEL

        def counted(method):
            def run(*args, **kwargs):
                with StepCounts(trainer.num_devices, world_dim) as counts:
                    result = method(*args, **kwargs)
                for kind, size in counts.collectives.items():
                    self.batches[-1]["bytes"][kind] = self.batches[-1]["bytes"].get(kind, 0) + size
                return result

            return run

        for name in ("training_step", "backward"):
            setattr(trainer.strategy, name, counted(getattr(trainer.strategy, name)))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self.batches.append({"epoch": trainer.current_epoch, "batch": batch_idx, "bytes": {}})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        path = Path(trainer.default_root_dir) / f"collectives_rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.batches))


class KillWhileWritingLast(L.Callback):
    """SIGKILLs this process while it writes its first ``last.ckpt``: the whole file is in ``last.ckpt.partial``, not
    yet renamed (``AtomicCheckpointIO``), and the epoch's best checkpoint, written just before, is on disk. What a
    node failure or a SLURM kill at that moment leaves."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        checkpoint_io = trainer.strategy.checkpoint_io
        save = checkpoint_io.save_checkpoint

        def save_then_die(checkpoint, path, storage_options=None) -> None:
            if Path(path).name == "last.ckpt":
                os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # after the write, before the rename
            save(checkpoint, path, storage_options)

        checkpoint_io.save_checkpoint = save_then_die


class SlowCheckpointWrites(L.Callback):
    """Each rank writes its shards of a distributed checkpoint ``seconds`` late, so that training goes on meanwhile
    when the write is in the background. With ``kill``, the process SIGKILLs itself once its shards of the
    ``kill``-th ``last.ckpt`` are written, before the metadata that completes the checkpoint: what a node failure
    in the middle of a write leaves. The epoch after that write's (epoch ``kill``: one ``last.ckpt`` an epoch) waits
    at its start for the kill, so that it comes while training goes on however the machine's load times the write
    against the epochs."""

    def __init__(self, seconds: float, kill: int = 0) -> None:
        self.seconds, self.kill = seconds, kill

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        from torch.distributed.checkpoint.filesystem import _FileSystemWriter

        write = _FileSystemWriter.write_data
        writes_of_last = []

        def late_write(writer, plan, planner):
            time.sleep(self.seconds)
            written = write(writer, plan, planner)
            if self.kill and Path(writer.path).name == "last.ckpt.partial":
                writes_of_last.append(writer.path)
                if len(writes_of_last) == self.kill:
                    written.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
            return written

        _FileSystemWriter.write_data = late_write

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        while self.kill and trainer.current_epoch == self.kill:  # until the background write's kill
            time.sleep(0.05)
