"""Token shards on disk (a fixed header, then the tokens, read back as memory maps) and the data module over a
prepared corpus (``python -m project.cli.prepare``): ``data=shards data.path=DIR``.

A shard is a 1 KiB header of 256 little-endian int32 (as llm.c's): ``[0]`` the magic number, ``[1]`` the format
version, ``[2]`` the number of tokens, ``[3]`` the bytes per token (2: uint16, when the vocabulary fits; else 4:
uint32); the tokens follow.
"""

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from project.data.codecs import TokenizerCodec
from project.data.datamodule import DataModule
from project.data.prepared import prepared_meta
from project.options.errors import ConfigError
from project.options.option_types import NonNegativeInt, PositiveInt, Seed
from project.options.writes import written

MAGIC = 20261122
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# What a preparation that cannot write its files stops with, after the path and the cause.
PREPARE_AGAIN = (
    "Preparation stopped; the shards written before are whole. Free space on that disk (or make --out writable), "
    "then run the same command again: it goes on from those shards."
)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """Write ``tokens`` (uint16 or uint32) as a shard, whole or not at all (a ``.partial`` file renamed)."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = [MAGIC, VERSION, len(tokens), tokens.dtype.itemsize]
    with written(path, "token shard", PREPARE_AGAIN) as partial, open(partial, "wb") as file:
        file.write(header.tobytes())
        file.write(tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes())
        file.flush()
        os.fsync(file.fileno())


def shard_header(path: Path) -> tuple[int, np.dtype]:
    """(tokens, their dtype) from a shard's header, once the file is whole: ``ValueError`` for a file that is not
    a shard of this format, or whose size is not what its header promises (truncated, or grown)."""
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if len(header) < 4 or header[0] != MAGIC:
        raise ValueError(f"{path} is not a token shard (no magic number {MAGIC} in its header).")
    if header[1] != VERSION:
        raise ValueError(f"{path} has shard format version {header[1]}; this code reads version {VERSION}.")
    dtypes: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # by the header's bytes per token
    if int(header[3]) not in dtypes:
        raise ValueError(f"{path} has {header[3]} bytes per token in its header; this code reads 2 or 4.")
    tokens, dtype = int(header[2]), dtypes[int(header[3])]
    expected = HEADER_BYTES + tokens * dtype.itemsize
    if path.stat().st_size != expected:
        raise ValueError(f"{path} has {path.stat().st_size} bytes; its header promises {expected}.")
    return tokens, dtype


def read_shard(path: Path) -> np.ndarray:
    """The shard's tokens as a read-only memory map (nothing is read until used)."""
    tokens, dtype = shard_header(path)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(tokens,))


class TokenWindows(Dataset):
    """Windows of ``seq_length + 1`` tokens over a split's shards, one after another (each overlapping the next by
    one token): window ``i`` gives ``(tokens[i*L : i*L + L], tokens[i*L + 1 : i*L + L + 1])`` with ``L`` the
    sequence length. The shards are memory-mapped on first use in each process (DataLoader workers open their
    own maps), so host memory holds only the pages read, whatever the corpus size."""

    def __init__(self, files: list[Path], lengths: list[int], seq_length: int) -> None:
        self.files, self.seq_length = files, seq_length
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])  # global index of each shard's first token
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return max(0, (int(self.offsets[-1]) - 1) // self.seq_length)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}  # workers reopen the maps rather than receive copies

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        if self._maps is None:
            self._maps = [read_shard(file) for file in self.files]
        pieces = []
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.offsets[shard + 1]))
            pieces.append(self._maps[shard][start - self.offsets[shard] : end - self.offsets[shard]])
            start, shard = end, shard + 1
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def __getitem__(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of windows at ``indices``: inputs and next-token targets, each (len(indices), seq_length)."""
        length = self.seq_length
        starts = [index * length for index in torch.as_tensor(indices).tolist()]
        windows = torch.from_numpy(
            np.stack([self._tokens(start, start + length + 1) for start in starts]).astype(np.int64)
        )
        return windows[:, :-1], windows[:, 1:]


class ShardsDataModule(DataModule):
    """The shards ``python -m project.cli.prepare`` wrote (``path``: its ``--out`` dir), read through memory maps
    as windows of ``seq_length + 1`` tokens, batched as every data module here (``GlobalBatchSampler``: the same
    global batches whatever the device count; every validation window once)."""

    seq_length: int
    vocab_size: int

    def text_codec(self) -> TokenizerCodec:
        try:
            return TokenizerCodec(self.path / "tokenizer.json")  # the tokenizer prepare used, saved beside the shards
        except ValueError as error:
            raise ConfigError(
                "data.path", f"{error}.", "prepare the corpus again (python -m project.cli.prepare ... --out DIR)."
            ) from None

    def __init__(
        self,
        path: str,
        seq_length: PositiveInt,
        batch_size: PositiveInt,
        seed: Seed,
        shuffle: bool = True,
        num_workers: NonNegativeInt = 0,
        vocab_size: PositiveInt | None = None,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, shuffle=shuffle, num_workers=num_workers)
        self.path = Path(path)
        self.meta = prepared_meta(self.path)
        self.seq_length = seq_length
        self.vocab_size = self.meta["vocab_size"]
        if vocab_size not in (None, self.vocab_size):
            raise ConfigError(
                "data.vocab_size",
                f"is {vocab_size}, but {self.path} was tokenized with a vocabulary of {self.vocab_size}.",
                "leave data.vocab_size unset: it comes from meta.json.",
            )
        for split in ("train", "val"):
            if len(self._windows(split)) < 1:
                raise ConfigError(
                    "data.path",
                    f"{self.path}'s {split} split has {self.meta['splits'][split]['tokens']} "
                    f"tokens, too few for one window of data.seq_length + 1 = {seq_length + 1}.",
                    "prepare a larger corpus (or a larger --val-fraction), or shorten data.seq_length.",
                )

    def check_files(self) -> None:
        """Every shard meta.json lists is there, whole, and holds the tokens meta.json counts: read from the
        headers and file sizes by the checks before launch (a missing or cut shard would fail mid-epoch)."""
        for split in ("train", "val"):
            for shard in self.meta["splits"][split]["shards"]:
                path = self.path / shard["file"]
                try:
                    tokens, _ = shard_header(path)
                except (OSError, ValueError) as error:
                    problem = f"{path} is missing" if not path.exists() else str(error).rstrip(".")
                    raise ConfigError(
                        "data.path",
                        f"{problem}, a shard of the {split} split its meta.json lists.",
                        "prepare the corpus again (python -m project.cli.prepare ... --out DIR), or restore the "
                        "shard from a copy.",
                    ) from None
                if tokens != shard["tokens"]:
                    raise ConfigError(
                        "data.path",
                        f"{path} holds {tokens} tokens, but meta.json says {shard['tokens']}: the shard is from "
                        "another preparation.",
                        "prepare the corpus again into an empty dir (python -m project.cli.prepare ... --out DIR).",
                    )

    def _windows(self, split: str) -> TokenWindows:
        shards = self.meta["splits"][split]["shards"]
        return TokenWindows(
            [self.path / shard["file"] for shard in shards], [shard["tokens"] for shard in shards], self.seq_length
        )

    @property
    def num_train_samples(self) -> int:
        return len(self._windows("train"))

    @property
    def num_val_samples(self) -> int:
        return len(self._windows("val"))

    def setup(self, stage: str) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = self._windows("train"), self._windows("val")
