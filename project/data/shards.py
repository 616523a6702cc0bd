"""Token shards on disk: a fixed header, then the tokens, read back as memory maps.

A shard is a 1 KiB header of 256 little-endian int32 (as llm.c's): ``[0]`` the magic number, ``[1]`` the format
version, ``[2]`` the number of tokens, ``[3]`` the bytes per token (2: uint16, when the vocabulary fits; else 4:
uint32); the tokens follow.
"""

import os
from pathlib import Path

import numpy as np

MAGIC = 20261122
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """Write ``tokens`` (uint16 or uint32) as a shard, whole or not at all (a ``.partial`` file renamed)."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:4] = [MAGIC, VERSION, len(tokens), tokens.dtype.itemsize]
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        file.write(header.tobytes())
        file.write(tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes())
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def read_shard(path: Path) -> np.ndarray:
    """The shard's tokens as a read-only memory map (nothing is read until used)."""
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if len(header) < 4 or header[0] != MAGIC:
        raise ValueError(f"{path} is not a token shard (no magic number {MAGIC} in its header).")
    if header[1] != VERSION:
        raise ValueError(f"{path} has shard format version {header[1]}; this code reads version {VERSION}.")
    dtype = {2: np.dtype("<u2"), 4: np.dtype("<u4")}[int(header[3])]
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(int(header[2]),))
    expected = HEADER_BYTES + int(header[2]) * dtype.itemsize
    if path.stat().st_size != expected:
        raise ValueError(f"{path} has {path.stat().st_size} bytes; its header promises {expected}.")
    return tokens

