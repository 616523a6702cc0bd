"""A LightningDataModule for in-memory datasets, batched by ``GlobalBatchSampler``."""

import warnings
from collections.abc import Sized
from typing import cast

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, Dataset

from project.data.codecs import TextCodec
from project.data.sampling import EpochShuffle, GlobalBatchSampler, data_parallel_rank_and_size
from project.options.option_types import NonNegativeInt, PositiveInt, Seed

# The data module resumes its loader mid-epoch itself (``InMemoryDataModule.state_dict``); Lightning, looking only
# for a DataLoader with a state_dict, would warn that it cannot.
warnings.filterwarnings("ignore", message=r".*your dataloader is not resumable.*")


class InMemoryDataModule(L.LightningDataModule):
    """Subclasses build ``self.train_set`` and ``self.val_set`` in ``setup``, datasets indexed by a list of indices
    that return that batch (as ``TensorDataset`` is); this class batches them.

    ``batch_size`` is per data-parallel replica (the tutorial's rule: "keep batch size per GPU the same"), so the global
    batch is ``batch_size`` times the data-parallel replicas (devices x nodes for DDP and FSDP).
    """

    sequences_per_sample = 1  # rows of a batch's tensors per sample (a preference pair: 2)

    def __init__(
        self, batch_size: PositiveInt, seed: Seed, shuffle: bool = True, num_workers: NonNegativeInt = 0
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle  # reshuffle the training set every epoch (debug=overfit turns it off)
        self.num_workers = num_workers  # DataLoader worker processes (0: batches are read in the training process)
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self._resume_position: dict[str, int] | None = None

    @property
    def num_train_samples(self) -> int:
        """Training set size, known before ``setup`` so bad batch sizes are caught before workers start."""
        raise NotImplementedError

    @property
    def num_val_samples(self) -> int:
        """Validation set size, known before ``setup``."""
        raise NotImplementedError

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        assert self.trainer is not None  # loaders are built for the trainer this module is attached to
        rank, replicas = data_parallel_rank_and_size(self.trainer)
        order = EpochShuffle(len(cast(Sized, dataset)), shuffle=train and self.shuffle, seed=self.seed)
        batches = GlobalBatchSampler(order, self.batch_size, rank=rank, world_size=replicas, drop_last=train)
        # Whole batches read at once (batch_size=None: the sampler yields a batch's indices, the dataset is indexed
        # with them), not sample by sample and then collated: for tensors in memory, one indexing per batch.
        return DataLoader(
            dataset,
            sampler=batches,
            batch_size=None,
            pin_memory=torch.cuda.is_available(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def state_dict(self) -> dict[str, int]:
        """Where training stands in its data, kept in every checkpoint: the epoch under way and the batches of it
        trained on (a finished epoch: the next, at its start), so that a run resumed from a mid-epoch checkpoint
        trains on the batches it had not reached, in the epoch's own order.

        Counted by the training loop, not by the loader, which has always handed out more: Lightning fetches a
        batch ahead, workers more. Kept here rather than as a DataLoader's ``state_dict``, which Lightning also
        saves but does not load back when ``trainer.estimated_stepping_batches`` (the LR schedule's length) built
        the loader before the checkpoint was restored (Lightning issue #20550).
        """
        trainer = self.trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return {}
        # The batch progress's trackers are _ProcessedTracker objects, declared as their base class by Lightning.
        epoch = trainer.current_epoch
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
        if done >= trainer.num_training_batches:
            return {"epoch": epoch + 1, "batches": 0}
        return {"epoch": epoch, "batches": done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_position = state or None  # for the training loader, built after the checkpoint is read
        if self._resume_position is not None and self.trainer is not None:
            # Strategies that restore the checkpoint after their setup (fsdp, model_parallel, pipeline) have built
            # the training loader already, for the LR schedule's length, and started its iterator (DataLoader
            # workers fetch ahead at once). Dropping it makes the fit loop build it again, from train_dataloader;
            # Lightning offers no public way to do so.
            self.trainer.fit_loop._combined_loader = None

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None  # built in setup
        loader = self._loader(self.train_set, train=True)
        if self._resume_position is not None:
            cast(GlobalBatchSampler, loader.sampler).resume_at(
                self._resume_position["epoch"], self._resume_position["batches"]
            )
            self._resume_position = None
        return loader

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None  # built in setup
        return self._loader(self.val_set, train=False)

    def text_codec(self) -> TextCodec | None:
        """Text to token ids and back, for data made of text (None: the samples are not text)."""
        return None


class GeneratedDataModule(InMemoryDataModule):
    """For data made up in ``setup``: the split sizes are given, so they are known before any data exists."""

    def __init__(
        self, num_train: PositiveInt, num_val: PositiveInt, batch_size: PositiveInt, seed: Seed, shuffle: bool = True
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, shuffle=shuffle)
        self.num_train = num_train
        self.num_val = num_val

    @property
    def num_train_samples(self) -> int:
        return self.num_train

    @property
    def num_val_samples(self) -> int:
        return self.num_val
