"""Batch sampling that makes a run independent of how it is parallelised.

Lightning's default ``DistributedSampler`` shuffles per replica count and pads the last batch with repeated
samples, so ``ddp`` on 2 devices neither sees the batches of 1 device nor computes exact validation metrics.
Here ``EpochShuffle`` orders the whole set once per epoch (from ``seed`` and the epoch) and ``GlobalBatchSampler``
cuts that order into global batches and hands rank ``r`` the ``r``-th slice of each. Training drops the
incomplete last global batch; evaluation keeps every sample exactly once, in non-empty slices of near-equal size,
and gives every rank the same number of batches (collective-heavy strategies such as FSDP need that).
"""

from collections.abc import Iterator

import lightning as L
import torch
from torch.utils.data import Sampler


def data_parallel_rank_and_size(trainer: L.Trainer) -> tuple[int, int]:
    """This process's replica and the number of replicas that split each global batch.

    Lightning's strategies say it in ``distributed_sampler_kwargs``: every rank for DDP and FSDP, one per
    pipeline for pipeline parallelism (the stages of a pipeline share a batch); none on a single device.
    """
    kwargs = trainer.distributed_sampler_kwargs
    return (kwargs["rank"], kwargs["num_replicas"]) if kwargs else (0, 1)


class EpochShuffle(Sampler[int]):
    """The order of the whole set in one epoch: a permutation drawn from ``seed + epoch``, or the natural order.

    It depends on nothing else (not the process, not the device count). ``GlobalBatchSampler.set_epoch`` passes
    Lightning's call at every epoch start on to it.
    """

    def __init__(self, num_samples: int, shuffle: bool, seed: int = 0) -> None:
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def order(self) -> torch.Tensor:
        """The epoch's order as one tensor of 4 bytes a sample (int32, the same permutation as int64's), not a
        Python list (some 40 bytes a sample), which for a corpus of billions of tokens would cost a rank gigabytes."""
        dtype = torch.int32 if self.num_samples < 2**31 else torch.int64
        if not self.shuffle:
            return torch.arange(self.num_samples, dtype=dtype)
        return torch.randperm(
            self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch), dtype=dtype
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.order().tolist())


class GlobalBatchSampler(Sampler[torch.Tensor]):
    """Yields this rank's slice of each global batch of ``batch_size * world_size`` samples, in ``sampler``'s order:
    a tensor of indices, which a dataset of tensors indexes at once (a list of them it converts first, every
    batch)."""

    def __init__(
        self,
        sampler: EpochShuffle,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        num_samples = len(sampler)
        global_batch = batch_size * world_size
        if drop_last and num_samples < global_batch:
            raise ValueError(f"{num_samples} samples cannot fill one global batch of {global_batch}")
        if not drop_last and num_samples < world_size:
            raise ValueError(f"{num_samples} samples cannot give each of {world_size} ranks one")
        self.sampler = sampler
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        if drop_last:
            self.num_global_batches = num_samples // global_batch
        else:  # ceil, but never more slices than samples: an evaluation slice may then hold one extra sample
            self.num_global_batches = min(-(-num_samples // global_batch), num_samples // world_size)
        self._skip = 0  # global batches the next iteration leaves out: those a resumed run has already trained on

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this at every epoch start on the DataLoader's sampler (this object)."""
        self.sampler.set_epoch(epoch)

    def resume_at(self, epoch: int, batches_done: int) -> None:
        """Make the next iteration continue epoch ``epoch`` after its first ``batches_done`` global batches (a
        finished epoch continues as the next one from its start)."""
        if batches_done >= self.num_global_batches:
            epoch, batches_done = epoch + 1, 0
        self.sampler.set_epoch(epoch)
        self._skip = batches_done

    def __len__(self) -> int:
        return self.num_global_batches

    def __iter__(self) -> Iterator[torch.Tensor]:
        order = self.sampler.order()
        used = order[: self.num_global_batches * self.batch_size * self.world_size] if self.drop_last else order
        # One slice per (global batch, rank), sizes differing by at most one (torch.tensor_split's cut, computed
        # here for this rank's slices only: a view per slice of every rank costs hundreds of bytes a batch); slice
        # i*W + r is rank r's part of global batch i. With drop_last every slice has exactly batch_size samples.
        parts = self.num_global_batches * self.world_size
        size, larger = divmod(len(used), parts)  # the first `larger` slices hold one sample more
        skip, self._skip = self._skip, 0
        for batch in range(skip, self.num_global_batches):
            part = batch * self.world_size + self.rank
            start = part * size + min(part, larger)
            yield used[start : start + size + (part < larger)]
