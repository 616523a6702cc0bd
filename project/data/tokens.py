"""Token data: a synthetic language whose best possible loss is known, and byte-level text from a local file.

``MarkovTokenDataModule``: sequences from a random sparse Markov chain over the vocabulary. Each token has
``branching`` possible successors with random probabilities, so the next token depends on the current one only
and no model can beat the chain's entropy rate H = sum_s pi(s) * H(P(s, .)) nats per token (pi: the stationary
distribution). A trained model's loss approaches H from above: ``entropy_floor``.
"""

from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from project.data.codecs import BytesCodec
from project.data.datamodule import DataModule, GeneratedDataModule
from project.options.errors import ConfigError
from project.options.option_types import ExistingFile, OpenFraction, PositiveInt, Seed


def random_markov_chain(vocab_size: int, branching: int, generator: torch.Generator) -> torch.Tensor:
    """A (vocab, vocab) transition matrix; row s spreads Dirichlet(1) weights over ``branching`` random successors."""
    transitions = torch.zeros(vocab_size, vocab_size)
    for state in range(vocab_size):
        successors = torch.randperm(vocab_size, generator=generator)[:branching]
        weights = -torch.log(torch.rand(branching, generator=generator))  # Dirichlet(1) by normalised exponentials
        transitions[state, successors] = weights / weights.sum()
    return transitions


def stationary_distribution(transitions: torch.Tensor, steps: int = 10_000) -> torch.Tensor:
    """pi with pi P = pi, by power iteration from the uniform distribution (in float64, renormalised so float32
    rows that sum to 1 only up to rounding do not drift)."""
    transitions = transitions.double()
    transitions = transitions / transitions.sum(dim=1, keepdim=True)
    pi = torch.full((len(transitions),), 1.0 / len(transitions), dtype=torch.float64)
    for _ in range(steps):
        pi = pi @ transitions
        pi = pi / pi.sum()
    return pi


def entropy_rate(transitions: torch.Tensor) -> float:
    """Nats per token of the chain in its stationary regime: the best achievable cross-entropy."""
    p = transitions.double()
    row_entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(dim=1)
    return float(stationary_distribution(transitions) @ row_entropy)


def sample_sequences(
    transitions: torch.Tensor, num_sequences: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    """``num_sequences`` walks of ``length`` tokens, each started from the stationary distribution."""
    tokens = torch.empty(num_sequences, length, dtype=torch.long)
    tokens[:, 0] = torch.multinomial(
        stationary_distribution(transitions).float(), num_sequences, replacement=True, generator=generator
    )
    for position in range(1, length):
        tokens[:, position] = torch.multinomial(transitions[tokens[:, position - 1]], 1, generator=generator).squeeze(1)
    return tokens


def next_token_dataset(sequences: torch.Tensor) -> TensorDataset:
    """Inputs are each sequence but its last token; targets, each but its first."""
    return TensorDataset(sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous())


class MarkovTokenDataModule(GeneratedDataModule):
    """Train and validation sequences from one random Markov chain, deterministic from ``seed``."""

    seq_length: int
    vocab_size: int

    def __init__(
        self,
        vocab_size: PositiveInt,
        branching: PositiveInt,
        seq_length: PositiveInt,
        num_train: PositiveInt,
        num_val: PositiveInt,
        batch_size: PositiveInt,
        seed: Seed,
        shuffle: bool = True,
    ) -> None:
        super().__init__(num_train=num_train, num_val=num_val, batch_size=batch_size, seed=seed, shuffle=shuffle)
        self.vocab_size, self.branching, self.seq_length = vocab_size, branching, seq_length
        self._transitions: torch.Tensor | None = None
        self._entropy_floor: float | None = None

    @property
    def transitions(self) -> torch.Tensor:
        if self._transitions is None:
            self._transitions = random_markov_chain(
                self.vocab_size, self.branching, torch.Generator().manual_seed(self.seed)
            )
        return self._transitions

    @property
    def entropy_floor(self) -> float:
        """The best achievable validation loss, in nats per token."""
        if self._entropy_floor is None:
            self._entropy_floor = entropy_rate(self.transitions)
        return self._entropy_floor

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        generator = torch.Generator().manual_seed(self.seed + 1)
        sequences = sample_sequences(self.transitions, self.num_train + self.num_val, self.seq_length + 1, generator)
        self.train_set = next_token_dataset(sequences[: self.num_train])
        self.val_set = next_token_dataset(sequences[self.num_train :])


class TextDataModule(DataModule):
    """Byte-level tokens (vocabulary 256) of a local text file, cut into sequences; the last ``val_fraction`` of
    the file is the validation split, so no text is in both."""

    vocab_size = 256  # every byte
    seq_length: int

    def text_codec(self) -> BytesCodec:
        return BytesCodec()

    def __init__(
        self,
        path: ExistingFile,
        seq_length: PositiveInt,
        val_fraction: OpenFraction,
        batch_size: PositiveInt,
        seed: Seed,
        shuffle: bool = True,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, shuffle=shuffle)
        self.path, self.seq_length, self.val_fraction = Path(path), seq_length, val_fraction
        num_train, num_val = self._split_sizes()
        if num_train < 1 or num_val < 1:
            size = self.path.stat().st_size
            if num_train + num_val < 2 or num_train < 1:
                raise ConfigError(
                    "data.path",
                    f"{self.path} has {size} bytes, too few for one training and one validation sequence of "
                    f"data.seq_length + 1 = {seq_length + 1} bytes.",
                    "use a longer text file, or a shorter data.seq_length.",
                )
            raise ConfigError(
                "data.val_fraction",
                f"is {val_fraction}: the last {int(size * val_fraction)} bytes of {self.path} hold no validation "
                f"sequence of data.seq_length + 1 = {seq_length + 1} bytes.",
                f"raise it to at least {(seq_length + 2) / size:.3g}, or shorten data.seq_length.",
            )

    def _split_sizes(self) -> tuple[int, int]:
        """Sequences in each split (of seq_length + 1 tokens, overlapping by one), from the file size alone."""
        num_bytes = self.path.stat().st_size
        val_bytes = int(num_bytes * self.val_fraction)
        return (num_bytes - val_bytes - 1) // self.seq_length, (val_bytes - 1) // self.seq_length

    @property
    def num_train_samples(self) -> int:
        return self._split_sizes()[0]

    @property
    def num_val_samples(self) -> int:
        return self._split_sizes()[1]

    def _sequences(self, data: torch.Tensor, count: int) -> torch.Tensor:
        starts = torch.arange(count) * self.seq_length
        return data[starts[:, None] + torch.arange(self.seq_length + 1)]

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        data = torch.frombuffer(bytearray(self.path.read_bytes()), dtype=torch.uint8).long()
        num_train, num_val = self._split_sizes()
        val_start = len(data) - int(len(data) * self.val_fraction)
        self.train_set = next_token_dataset(self._sequences(data[:val_start], num_train))
        self.val_set = next_token_dataset(self._sequences(data[val_start:], num_val))
