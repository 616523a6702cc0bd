"""The data-module contract (``DataModule``): what every data module here holds and offers, declared once and held
to by mypy, so that no part of the project asks a data module for anything by name; and the batches it makes
(``GlobalBatchSampler``), the same global batches for any device count.

A batch is ``(inputs, target)``: rows of the model's inputs and the targets its task's loss reads (a sample is
``sequences_per_sample`` rows). Its shapes are the module's ``shape`` (``DataShape``), which the memory plan's
simulated step is fed with.
"""

import warnings
from collections.abc import Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import ClassVar, cast

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, Dataset

from project.data.codecs import TextCodec
from project.data.sampling import EpochShuffle, GlobalBatchSampler, data_parallel_rank_and_size
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.options.option_types import NonNegativeInt, PositiveInt, Seed

# The data module resumes its loader mid-epoch itself (``DataModule.state_dict``); Lightning, looking only for a
# DataLoader with a state_dict, would warn that it cannot.
warnings.filterwarnings("ignore", message=r".*your dataloader is not resumable.*")

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, target), a row per sequence


@dataclass(frozen=True)
class DataShape:
    """A batch's shapes, as its data module declares them (``DataModule.shape``): tokens per sequence
    (``seq_length``: ``data.seq_length``) or features per sample (``num_features``: ``data.num_features``), the rows a
    sample takes (``sequences_per_sample``: a preference pair's two), and whether the target holds each row's sample
    index as one more column (``index_column``: what keys the values a task computed of every sample before
    training, ``project.tasks.precomputation``)."""

    seq_length: int | None
    num_features: int | None
    sequences_per_sample: int = 1
    index_column: bool = False

    def example_batch(self, batch_size: int) -> Batch:
        """A batch of ``batch_size`` samples of these shapes and the data's dtypes, of zeros: token ids and their
        targets (one tensor for both, where they have one shape), or features and class labels."""
        if self.seq_length is None:
            assert self.num_features is not None, "data has a sequence length or features"
            return torch.zeros(batch_size, self.num_features), torch.zeros(batch_size, dtype=torch.long)
        rows = batch_size * self.sequences_per_sample
        target = torch.zeros(rows, self.seq_length + self.index_column, dtype=torch.long)
        return target[:, : self.seq_length], target


def split_index_column(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A target that holds its rows' sample indices as its last column (``DataShape.index_column``): its own
    columns, and each row's sample index."""
    return target[:, :-1], target[:, -1]


class DataModule(L.LightningDataModule):
    """What a data module holds and offers. Subclasses build ``self.train_set`` and ``self.val_set`` in ``setup``,
    datasets indexed by a list of indices that return that batch (as ``TensorDataset`` is); this class batches them.

    ``batch_size`` is per data-parallel replica (the tutorial's rule: "keep batch size per GPU the same"), so the global
    batch is ``batch_size`` times the data-parallel replicas (devices x nodes for DDP and FSDP).

    What a subclass declares beyond its samples, each with its default here: its vocabulary and sequence length
    (token data) or features (``num_features``), the rows of a sample, the index column, the best loss its data
    allows (``entropy_floor``), its text codec, the check of its files, its samples' fingerprint, and its rules on
    the model and the task that train on it (``model_problem``, ``task_problem``). It offers every sample, replica
    by replica (``every_sample``), to a task that computes something of each before training.
    """

    sequences_per_sample: ClassVar[int] = 1  # rows of a batch's tensors per sample (a preference pair: 2)
    index_column: ClassVar[bool] = False  # the target's last column is each row's sample index (DataShape)
    vocab_size: int | None = None  # token ids are below it (token data)
    seq_length: int | None = None  # tokens per sequence (token data)
    num_features: int | None = None  # features per sample (feature data)

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

    @property
    def shape(self) -> DataShape:
        """The shapes of its batches: what the memory plan feeds a simulated step (``Job.data``)."""
        return DataShape(self.seq_length, self.num_features, self.sequences_per_sample, self.index_column)

    @property
    def entropy_floor(self) -> float | None:
        """The best validation loss the data allows, in nats per token, where it is known (None: it is not)."""
        return None

    def text_codec(self) -> TextCodec | None:
        """Text to token ids and back, for data made of text (None: the samples are not text)."""
        return None

    def check_files(self) -> None:
        """Check the files the data is read from, before launch, where reading them whole when the module is built
        would cost too much (``data=shards``'s memory maps); the other modules have checked theirs by then."""

    def fingerprint(self) -> str | None:
        """A digest of every sample, where the module holds them all (None: it does not): what values a task
        computed of them before training, and kept in a checkpoint, were of."""
        return None

    def task_problem(self, task: str, sequences_per_sample: int) -> ConfigError | None:
        """Why the data cannot train the task module ``task`` (its class name), whose loss reads
        ``sequences_per_sample`` rows as one sample, or None (it can)."""
        return None

    def model_problem(self, net: BlockSequence, model_vocab: int | None) -> ConfigError | None:
        """Why ``net`` (on the meta device), of ``model_vocab`` tokens (``model.net.vocab_size``), cannot take the
        data's sequences, or None: a language model's embedding needs a row for every token the data holds
        (``model.init_from`` gives the model the vocabulary of its dir, which the data need not fill), and a model
        with learned positions one for every token of a sequence."""
        if self.vocab_size is not None and model_vocab is not None and self.vocab_size > model_vocab:
            return ConfigError(
                "model.net.vocab_size",
                f"is {model_vocab}, fewer than the {self.vocab_size} tokens of the data's vocabulary: token ids past "
                f"{model_vocab - 1} would have no embedding.",
                "give the model the data's vocabulary (model.net.vocab_size=${data.vocab_size}), or prepare the data "
                "with the model's own tokenizer.json.",
            )
        positions, length = net.max_positions, self.seq_length
        if positions is not None and length is not None and length > positions:
            return ConfigError(
                "data.seq_length",
                f"is {length}, longer than the model's {positions} learned positions: positions past {positions - 1} "
                "would have no embedding.",
                f"use data.seq_length={positions} or less, or give the model more positions "
                "(model.net.max_length=${data.seq_length}, its default, when it is not read from model.init_from).",
            )
        return None

    def every_sample(self, rank: int, replicas: int) -> Iterator[tuple[torch.Tensor, Batch]]:
        """Every sample of both splits (training's, then validation's, indexed on), each once over the ``replicas``
        data-parallel replicas: replica ``rank``'s share in batches of at most ``batch_size`` samples, each with its
        samples' indices. As many batches on every replica (``GlobalBatchSampler``'s evaluation slices), as layouts
        whose ranks run collectives need. After ``setup``."""
        count = self.num_train_samples + self.num_val_samples
        for indices in GlobalBatchSampler(EpochShuffle(count, shuffle=False), self.batch_size, rank, replicas):
            yield indices, self.samples_at(indices)

    def samples_at(self, indices: Sequence[int] | torch.Tensor) -> Batch:
        """The batch of the samples at ``indices`` (training's first, then validation's, as ``every_sample``
        counts them)."""
        assert self.train_set is not None and self.val_set is not None  # built in setup
        first_val = self.num_train_samples
        indices = torch.as_tensor(indices, dtype=torch.long)
        training = indices < first_val
        parts = [
            cast(Batch, dataset[chosen])
            for dataset, chosen in ((self.train_set, indices[training]), (self.val_set, indices[~training] - first_val))
            if len(chosen)
        ]
        inputs, target = (torch.cat(tensors) for tensors in zip(*parts, strict=True))
        return inputs, target


def trainer_data(trainer: L.Trainer) -> DataModule:
    """The data module ``trainer`` trains on (set on it by Lightning's data connector, which its class does not
    declare)."""
    data = trainer.datamodule  # type: ignore[attr-defined]
    assert isinstance(data, DataModule), f"{type(data).__name__} is not a project.data.datamodule.DataModule"
    return data


class GeneratedDataModule(DataModule):
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
