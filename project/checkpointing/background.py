"""Distributed checkpoints written in the background (``callbacks.model_checkpoint.async_save``), torchtitan's way:
each rank's shards are copied to host memory while training waits (the staging), then written by a thread, through
``torch.distributed.checkpoint.async_save``, while training goes on.

A checkpoint is written into ``<name>.partial`` and swapped in for ``<name>`` only once every rank's shards and the
metadata are on disk, so ``last.ckpt`` is always a whole checkpoint: the previous one until the new one is
complete. A save due while the previous one is still being written waits for it first (and says so). A write that
fails leaves the previous checkpoint as it was; the run stops with the cause at the next point every rank reaches
together (the next save, or the end of training), so that no rank stops alone.
"""

import logging
import os
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from project.options.log_records import LOG_FILE_ONLY
from project.options.writes import remove

log = logging.getLogger(__name__)
# DCP's on every save of one rank alone (no_dist: CheckpointWriter.start, ShardedStrategy.save_checkpoint).
warnings.filterwarnings("ignore", message=r"torch.distributed is disabled")


def swap_in(partial: Path, final: Path) -> None:
    """Replace ``final`` (a checkpoint dir, or nothing) by the complete ``partial`` one: the old one moves aside
    first, so that a crash in between leaves one of them whole."""
    previous = final.with_name(final.name + ".previous")
    remove(previous)
    if final.exists():
        final.replace(previous)
    partial.replace(final)
    remove(previous)


@runtime_checkable
class WritesInBackground(Protocol):
    """A strategy that can write its checkpoints in the background (``ShardedStrategy``): what the checkpoint
    callback sets and calls."""

    async_save: bool

    def finish_checkpoint_writes(self, before: Path | None = None) -> None: ...


class BackgroundWrite:
    """One checkpoint on its way to disk: ``wait`` blocks until it is there (or raises why not). On the rank that
    ``swaps`` (rank 0), the finished write is swapped in as soon as it completes, from the writing thread."""

    def __init__(self, future: Future, partial: Path, final: Path, swaps: bool) -> None:
        self.partial, self.final, self.swaps = partial, final, swaps
        self.error: BaseException | None = None
        self._finished = threading.Event()  # set after the swap, which a waiter must not overtake
        future.add_done_callback(self._finish)

    def _finish(self, future: Future) -> None:
        try:
            future.result()
            if self.swaps:
                swap_in(self.partial, self.final)
        except BaseException as error:  # the run stops with it at the next save or at the end (CheckpointWriter)
            self.error = error  # the partial dir stays until then: what it holds tells a full disk apart
            if self.swaps:
                log.error(
                    f"Checkpoint {self.final} could not be written in the background ({error.__class__.__name__}); "
                    f"{self.final.name} still holds the previous checkpoint, if there was one."
                )
        finally:
            self._finished.set()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> None:
        self._finished.wait()
        if self.error is not None:
            raise self.error


class CheckpointWriter:
    """Writes a strategy's distributed checkpoints in the background, one at a time, over a process group of its own
    (gloo: the writing thread's collectives would otherwise interleave with training's on the same group)."""

    def __init__(self) -> None:
        self.pending: BackgroundWrite | None = None
        self._group: dist.ProcessGroup | None = None

    def start(self, state: dict[str, Any], partial: Path, final: Path, rank: int) -> None:
        """Copy ``state`` (this rank's shards) to host memory and write it to ``partial`` in the background, to be
        swapped in for ``final``. Every rank calls it together, after ``finish``."""
        # One rank alone writes without DCP's collectives (the files are the same): gloo would run their copies of
        # the plans on its own threads, whose OpenMP thread teams outlive the save; with more OpenMP threads than
        # cores, libgomp then sleeps at every wait instead of spinning (a small model's step took twice as long).
        no_dist = dist.get_world_size() == 1
        if self._group is None and not no_dist:  # made by every rank together, at the first save
            self._group = dist.new_group(backend="gloo")
        future = dcp.async_save(state, checkpoint_id=partial, process_group=self._group, no_dist=no_dist)
        assert isinstance(future, Future)  # (an AsyncSaveResponse only for a stager that stages asynchronously)
        self.pending = BackgroundWrite(future, partial, final, swaps=rank == 0)

    def finish(self, before: Path | None = None) -> None:
        """Wait for the checkpoint being written, if any (saying so when ``before``, the next one, has to wait for
        it), and raise what stopped it."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        if before is not None and not pending.done:  # the normal course at an improving epoch: the log file's
            message = f"Checkpoint {pending.final.name} is still being written; {before.name} waits for it."
            log.info(message, extra=LOG_FILE_ONLY)
        pending.wait()

    def close(self) -> None:
        """Wait for the last write, whatever became of it: the run is ending (an error is already in the log, and
        its partial dir goes)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending._finished.wait()
            if pending.error is not None and pending.swaps:
                remove(pending.partial)


def available_host_memory() -> int:
    """Bytes of host memory available now: Linux's ``MemAvailable`` (free memory and the page cache it can drop),
    else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def staged_copy_fits(state_bytes: int, ranks_on_node: int) -> bool:
    """Whether this node's ranks' staged copies (``state_bytes`` each) fit in half the host memory available now:
    where they would not, a checkpoint is written synchronously (the copy is what makes it asynchronous)."""
    return state_bytes * ranks_on_node <= available_host_memory() // 2
