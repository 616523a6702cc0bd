"""Tokenize a local corpus into token shards:
``python -m project.cli.prepare <files or dirs...> --out DIR [--tokenizer tokenizer.json | --vocab-size N]``.

Inputs: text files (one document each), ``.jsonl`` files (one document per line, its ``--text-key`` field) and
``.parquet`` files (the ``--text-key`` column; needs pyarrow), or directories of them, read in sorted order.
A document longer than ``PIECE_CHARS`` is taken in pieces of about that length (a text file is read a piece at a
time), so that memory stays bounded whatever the length of a line. Each cut is where the tokenizer's own
pre-tokenizer puts a boundary (``pre_tokenize_str``): no token spans one, so the pieces' tokens are the document's.
The tokenizer is a Hugging Face ``tokenizer.json`` (GPT-2's, Llama 3's...) or, without one, a byte-level BPE
trained on the corpus with HF ``tokenizers``. Each document is followed by the separator token. A fixed share of
the documents (chosen by a hash of their index), all their pieces, goes to the validation split.
Tokens go into fixed-size shards (``project.data.shards``) per split; ``meta.json`` describes them. HF
``tokenizers`` encodes batches of pieces on all cores.

Interrupted, the same command continues: ``progress.json`` records, after every shard, where each split's
unwritten tokens begin (piece and token), and finished shards are not written again.
"""

import argparse
import codecs
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from project.cli.usage import run_cli
from project.data.codecs import read_tokenizer
from project.data.shards import PREPARE_AGAIN, token_dtype, write_shard
from project.options.errors import ConfigError, check_writable
from project.options.writes import written

SEPARATORS = ["<|endoftext|>", "<|end_of_text|>", "</s>"]  # GPT-2's, Llama 3's, Llama 2's and others'
ENCODE_BATCH = 256  # pieces per call: HF tokenizers spreads a batch over all cores...
ENCODE_CHARS = 4 * 2**20  # ...and at most this many characters, as its memory grows many times over with them
# A longer document is tokenized in pieces of about this many characters: HF tokenizers would take gigabytes for one
# 50 MB line.
PIECE_CHARS = 2**16
# Text past a piece's end that its cut is chosen with: a pre-tokenizer's boundary can depend on what follows it
# (GPT-2's and Llama 3's patterns give a run of spaces before a word all but its last).
LOOKAHEAD_CHARS = 2**10
LOOKBACK_CHARS = 2**13  # the end of a piece that its cut is looked for in first (pre-tokenizing all of it is slow)


def bpe_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of the byte-level BPE prepare trains (GPT-2's kind)."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


def _skipped(relative: Path) -> bool:
    """Inside an input dir: hidden files and dirs, and Python's byte-code caches (binary, not text)."""
    return any(part.startswith(".") or part == "__pycache__" for part in relative.parts)


def is_binary(path: Path) -> bool:
    """Whether ``path`` (not a .parquet file) is not UTF-8 text, by its first 64 KiB: a NUL byte, or bytes UTF-8
    cannot decode (an executable, an image, random bytes). Such a file would be tokenized as noise."""
    if path.suffix == ".parquet":
        return False
    with open(path, "rb") as file:
        head = file.read(65536)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)  # a character cut at the end is fine
    except UnicodeDecodeError:
        return True
    return b"\0" in head


def input_files(paths: list[Path]) -> list[Path]:
    """The corpus's files: those given, and the text files under the dirs given (hidden ones, byte-code caches and
    binary files left out, the last said on the console); ``ConfigError`` for a path that is not one."""
    fix = "give text, .jsonl or .parquet files, or dirs of them."
    files, binary = [], []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not _skipped(p.relative_to(path)))
            binary += [p for p in found if is_binary(p)]
            files += [p for p in found if p not in binary]
        elif path.is_file():
            if is_binary(path):
                raise ConfigError("inputs", f"{path} is not text (not UTF-8: binary data).", fix)
            files.append(path)
        elif os.path.lexists(path):
            what = (
                "a link that loops or leads nowhere" if path.is_symlink() else "not a regular file (a FIFO, a device)"
            )
            raise ConfigError("inputs", f"{path} is {what}.", fix)
        else:
            raise ConfigError("inputs", f"{path} does not exist.", fix)
    if binary:
        names = ", ".join(str(p) for p in binary[:3]) + (f" and {len(binary) - 3} more" if len(binary) > 3 else "")
        print(f"Left out {len(binary)} binary file(s), not UTF-8 text: {names}", file=sys.stderr)
    if not files:
        raise ConfigError(
            "inputs", f"{', '.join(map(str, paths))} holds no text files.", "give dirs that hold the corpus."
        )
    return files


def pieces(
    files: list[Path], text_key: str, pre_tokenizer: pre_tokenizers.PreTokenizer | None
) -> Iterator[tuple[str, bool]]:
    """Every document of the corpus in a fixed order, in pieces of at most ``PIECE_CHARS`` characters cut at
    ``pre_tokenizer``'s boundaries, each with whether it ends its document; a text file is read a piece at a time."""
    for path in files:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as lines:
                for number, line in enumerate(lines, 1):
                    if line.strip():
                        yield from _cut(_slices(_jsonl_text(path, number, line, text_key)), pre_tokenizer)
        elif path.suffix == ".parquet":
            try:
                import pyarrow.parquet as parquet
            except ImportError:
                raise ConfigError("inputs", f"{path}: reading parquet needs pyarrow.", "pip install pyarrow.") from None
            for batch in parquet.ParquetFile(path).iter_batches(columns=[text_key]):
                for text in batch.column(0).to_pylist():
                    yield from _cut(_slices(text), pre_tokenizer)
        else:
            with open(path, encoding="utf-8", errors="replace") as file:
                yield from _cut(iter(lambda: file.read(PIECE_CHARS), ""), pre_tokenizer)


def _slices(text: str) -> Iterator[str]:
    return (text[start : start + PIECE_CHARS] for start in range(0, len(text), PIECE_CHARS))


def _cut(chunks: Iterator[str], pre_tokenizer: pre_tokenizers.PreTokenizer | None) -> Iterator[tuple[str, bool]]:
    """One document, given as ``chunks`` of text, as pieces of at most ``PIECE_CHARS`` characters, with whether
    each is the last; an empty document is one empty piece. Each cut is the last boundary of ``pre_tokenizer``'s
    words within the piece, seen with ``LOOKAHEAD_CHARS`` of what follows (a tokenizer without a pre-tokenizer:
    the last whitespace). A word longer than a piece is cut where the piece ends: only there can the tokens differ
    from the whole document's."""
    buffer = ""
    for chunk in chunks:
        buffer += chunk
        while len(buffer) > PIECE_CHARS + LOOKAHEAD_CHARS:
            cut = _last_boundary(buffer[: PIECE_CHARS + LOOKAHEAD_CHARS], pre_tokenizer) or PIECE_CHARS
            yield buffer[:cut], False
            buffer = buffer[cut:]
    while len(buffer) > PIECE_CHARS:  # the document's end is in the buffer: its boundaries are final
        cut = _last_boundary(buffer, pre_tokenizer) or PIECE_CHARS
        yield buffer[:cut], False
        buffer = buffer[cut:]
    yield buffer, True


def _last_boundary(text: str, pre_tokenizer: pre_tokenizers.PreTokenizer | None) -> int:
    """The last place in ``text``'s first ``PIECE_CHARS`` characters (not at its start) where ``pre_tokenizer``
    begins a word, or 0 where there is none."""
    if pre_tokenizer is None:
        return max(text.rfind(space, 1, PIECE_CHARS + 1) for space in " \n\t")
    # The words of the piece's last LOOKBACK_CHARS, those that begin past the first LOOKAHEAD_CHARS of them (a word
    # the window's start cut differs; a boundary that far from it is the whole text's), else of the whole text.
    window = max(0, PIECE_CHARS - LOOKBACK_CHARS)
    for offset, settled in ((window, window + LOOKAHEAD_CHARS if window else 1), (0, 1)):
        words = pre_tokenizer.pre_tokenize_str(text[offset:])
        starts = [offset + start for _, (start, _) in words if settled <= offset + start <= PIECE_CHARS]
        if starts:
            return max(starts)
    return 0


def _jsonl_text(path: Path, number: int, line: str, text_key: str) -> str:
    """The ``text_key`` field of line ``number`` of a .jsonl file."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError("inputs", f"{path} line {number} is not JSON ({error}).", "fix or remove the line.") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
        raise ConfigError(
            "--text-key",
            f"is {text_key!r}, but line {number} of {path} has no such text field.",
            "name the field that holds each document's text: --text-key <field>.",
        )
    return record[text_key]


def check_apart(inputs: list[Path], out: Path) -> None:
    """``ConfigError`` for an ``--out`` dir that is an input dir or inside one (its shards, tokenizer and meta.json
    would be read as documents by the next run, which then refuses its own re-run), or an input that is a prepared
    corpus (its JSON files and token shards are no text to tokenize)."""
    target = out.resolve()
    for path in inputs:
        source = path.resolve()
        if target == source or source in target.parents:
            where = "the input" if target == source else "inside the input"
            raise ConfigError(
                "--out",
                f"{out} is {where} {path}: what it writes would be read as documents of the corpus.",
                "give an --out dir outside the inputs.",
            )
        if source.is_dir() and all((source / name).is_file() for name in ("meta.json", "tokenizer.json")):
            raise ConfigError(
                "inputs",
                f"{path} is a corpus prepared already (its meta.json): its files are token shards, not text.",
                f"train on it with data=shards data.path={path}, or give the raw text it was prepared from.",
            )


def check_arguments(out: Path, vocab_size: int, shard_tokens: int, val_fraction: float) -> None:
    """``ConfigError`` naming the argument, before anything is written: sizes and fractions in range, ``--out``
    writable."""
    smallest = len(pre_tokenizers.ByteLevel.alphabet()) + 1  # every byte, and the separator
    if vocab_size < smallest:
        raise ConfigError(
            "--vocab-size",
            f"is {vocab_size}, fewer than a byte-level BPE's {smallest} tokens (every byte, and the separator).",
            f"use at least {smallest} (8192 and more learn useful merges).",
        )
    if shard_tokens < 1:
        raise ConfigError("--shard-tokens", f"is {shard_tokens}.", "give the tokens per shard, e.g. 100000000.")
    if not 0 <= val_fraction < 1:
        raise ConfigError(
            "--val-fraction",
            f"is {val_fraction}, not a share of the documents (and the training split needs some).",
            "give a share from 0 (no validation split) to below 1, e.g. --val-fraction 0.005.",
        )
    check_writable("--out", out, "give a dir you can write: --out DIR.")


def check_documents(
    files: list[Path], text_key: str, val_fraction: float, pre_tokenizer: pre_tokenizers.PreTokenizer | None
) -> None:
    """``ConfigError`` unless the corpus gives each split a document with text (the validation split none when
    ``val_fraction`` is 0): read until one of each is found (the first few hundred documents, for the default
    share)."""
    found = {"train": False, "validation": val_fraction == 0}
    count = documents = 0
    for text, last in pieces(files, text_key, pre_tokenizer):
        count += 1
        if text.strip():
            found["validation" if is_validation(documents, val_fraction) else "train"] = True
        documents += last
        if all(found.values()):
            return
    if count == 0 or not (found["train"] or (found["validation"] and val_fraction > 0)):
        raise ConfigError("inputs", "hold no text.", "give the files of a corpus (or --text-key, its text field).")
    missing = next(split for split, seen in found.items() if not seen)
    raise ConfigError(
        "inputs",
        f"hold {documents} document{'s' * (documents != 1)} ({count} piece{'s' * (count != 1)} of up to "
        f"{PIECE_CHARS:,} characters), which give the {missing} split none (--val-fraction {val_fraction} sends "
        f"about 1 in {round(1 / val_fraction)} documents, each whole, to validation).",
        "give more documents, or a --val-fraction nearer 0.5.",
    )


def fingerprint(files: list[Path], settings: dict[str, Any]) -> str:
    """What the output depends on: the inputs (path, size, time) and the settings; a rerun must match it."""
    parts = [settings] + [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def train_bpe(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2's kind: any text round-trips) with ``<|endoftext|>`` as its separator."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = bpe_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SEPARATORS[0]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def separator_token(tokenizer: Tokenizer | None, separator: str | None) -> str:
    """The token after each document: ``--separator``, else the first of ``SEPARATORS`` the tokenizer has
    (``tokenizer`` None: the BPE that prepare trains, whose one special token is ``SEPARATORS[0]``); checked before
    anything is written."""
    fix = "name the tokenizer's end-of-document token: --separator <token>."
    if tokenizer is None:
        if separator not in (None, SEPARATORS[0]):
            raise ConfigError(
                "--separator",
                f"{separator!r} is not a token of the BPE prepare trains, whose separator is {SEPARATORS[0]}.",
                "leave --separator out, or give a --tokenizer that has that token.",
            )
        return SEPARATORS[0]
    if separator is None:
        found = next((token for token in SEPARATORS if tokenizer.token_to_id(token) is not None), None)
        if found is None:
            raise ConfigError(
                "--separator", f"is not given, and the tokenizer has none of {', '.join(SEPARATORS)}.", fix
            )
        return found
    if tokenizer.token_to_id(separator) is None:
        raise ConfigError("--separator", f"{separator!r} is not a token of the tokenizer.", fix)
    return separator


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    with written(path, "tokenizer", PREPARE_AGAIN) as partial:
        tokenizer.save(str(partial))


def is_validation(document: int, val_fraction: float) -> bool:
    """A fixed, well-spread share of the documents, each whole, the same whatever the batching."""
    return (document * 2654435761 % 2**32) / 2**32 < val_fraction


@dataclass
class Split:
    """One split's shards, and its tokens not yet in one: ``start`` is where they begin (piece, token), or the
    piece after the last one taken when none are pending."""

    name: str
    shards: list[dict[str, Any]] = field(default_factory=list)
    start: tuple[int, int] = (0, 0)
    pending: list[np.ndarray] = field(default_factory=list, repr=False)
    pending_from: list[tuple[int, int]] = field(default_factory=list, repr=False)  # (piece, first token)

    def add(self, piece: int, tokens: np.ndarray, first: int = 0) -> None:
        """Tokens ``first`` onwards of ``piece``."""
        if not self.pending:
            self.start = (piece, first)
        self.pending.append(tokens)
        self.pending_from.append((piece, first))

    def pending_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.pending)

    def take(self, count: int) -> np.ndarray:
        """The first ``count`` pending tokens; ``start`` moves to the token after them."""
        out, taken, last = [], 0, self.start[0]
        while taken < count:
            tokens, (index, first) = self.pending[0], self.pending_from[0]
            part = tokens[: count - taken]
            out.append(part)
            taken, last = taken + len(part), index
            if len(part) == len(tokens):
                self.pending.pop(0)
                self.pending_from.pop(0)
            else:
                self.pending[0] = tokens[len(part) :]
                self.pending_from[0] = (index, first + len(part))
        self.start = self.pending_from[0] if self.pending else (last + 1, 0)
        return np.concatenate(out)


def prepare(
    inputs: list[Path],
    out: Path,
    tokenizer_path: Path | None = None,
    vocab_size: int = 8192,
    separator: str | None = None,
    text_key: str = "text",
    shard_tokens: int = 100_000_000,
    val_fraction: float = 0.005,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into shards under ``out``; returns the metadata written to ``meta.json``."""
    files = input_files(inputs)
    check_apart(inputs, out)
    check_arguments(out, vocab_size, shard_tokens, val_fraction)
    # Read before anything is written.
    fix = "give a tokenizer.json, as tokenizers and transformers save."
    tokenizer = None if tokenizer_path is None else read_tokenizer(tokenizer_path, "--tokenizer", fix)
    separator_text = separator_token(tokenizer, separator)
    pre_tokenizer = bpe_pre_tokenizer() if tokenizer is None else tokenizer.pre_tokenizer
    check_documents(files, text_key, val_fraction, pre_tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "tokenizer": str(tokenizer_path) if tokenizer_path else f"bpe-{vocab_size}",
        "piece_chars": PIECE_CHARS,
        "pieces": "cut at the pre-tokenizer's boundaries, each document in one split",  # since 2026-11-28
        "text_key": text_key,
        "shard_tokens": shard_tokens,
        "val_fraction": val_fraction,
        "separator": separator,
    }
    key = fingerprint(files, settings)
    progress_file = out / "progress.json"
    progress = json.loads(progress_file.read_text()) if progress_file.is_file() else None
    if progress is not None and progress["fingerprint"] != key:
        raise ConfigError("--out", f"{out} holds a preparation of other inputs or settings.", "use another --out dir.")

    tokenizer_file = out / "tokenizer.json"
    if tokenizer is not None:
        save_tokenizer(tokenizer, tokenizer_file)
    elif progress is not None and tokenizer_file.is_file():
        tokenizer = Tokenizer.from_file(str(tokenizer_file))  # trained by the interrupted run
    else:
        tokenizer = train_bpe((text for text, _ in pieces(files, text_key, pre_tokenizer)), vocab_size)
        save_tokenizer(tokenizer, tokenizer_file)
    separator_id = tokenizer.token_to_id(separator_text)
    dtype = token_dtype(tokenizer.get_vocab_size())

    splits = {name: Split(name) for name in ("train", "val")}
    if progress is not None:
        for name, state in progress["splits"].items():
            splits[name].shards, splits[name].start = state["shards"], tuple(state["start"])
    resume_from = min(split.start[0] for split in splits.values())

    def save_progress() -> None:
        state = {name: {"shards": s.shards, "start": list(s.start)} for name, s in splits.items()}
        with written(progress_file, "progress file", PREPARE_AGAIN) as partial:
            partial.write_text(json.dumps({"fingerprint": key, "splits": state}))

    def flush(split: Split, final: bool) -> None:
        while split.pending_tokens() >= shard_tokens or (final and split.pending_tokens()):
            tokens = split.take(min(shard_tokens, split.pending_tokens()))
            name = f"{split.name}_{len(split.shards):06d}.bin"
            write_shard(out / name, tokens.astype(dtype))
            split.shards.append({"file": name, "tokens": len(tokens)})
            save_progress()

    save_progress()  # from here on, a rerun keeps the tokenizer
    total_bytes = sum(f.stat().st_size for f in files)
    columns = [TextColumn("Tokenizing"), BarColumn(), TransferSpeedColumn(), TimeRemainingColumn()]
    with Progress(*columns) as bar:
        task = bar.add_task("tokenize", total=total_bytes)
        batch: list[tuple[int, Split, str, bool]] = []  # (piece, its document's split, text, whether it ends it)

        def encode(batch: list[tuple[int, Split, str, bool]]) -> None:
            todo = [item for item in batch if item[0] >= item[1].start[0]]
            encodings = tokenizer.encode_batch([text for _, _, text, _ in todo], add_special_tokens=False)
            for (index, split, _, last), encoding in zip(todo, encodings):
                tokens = np.array(encoding.ids + [separator_id] * last, dtype=np.uint32)  # the document's end
                first = split.start[1] if index == split.start[0] else 0  # a finished shard holds the tokens before
                split.add(index, tokens[first:], first)
            for split in splits.values():
                flush(split, final=False)

        characters = document = 0
        for index, (text, last) in enumerate(pieces(files, text_key, pre_tokenizer)):
            bar.advance(task, len(text.encode("utf-8", errors="replace")))
            split = splits["val" if is_validation(document, val_fraction) else "train"]
            document += last
            if index < resume_from:
                continue  # in finished shards of both splits
            batch.append((index, split, text, last))
            characters += len(text)
            if len(batch) == ENCODE_BATCH or characters >= ENCODE_CHARS:
                encode(batch)
                batch, characters = [], 0
        encode(batch)
    for split in splits.values():
        flush(split, final=True)

    meta = {
        "format": "project token shards v1",
        "tokenizer": settings["tokenizer"],
        "tokenizer_file": tokenizer_file.name,
        "vocab_size": tokenizer.get_vocab_size(),
        "dtype": dtype.name,
        "separator": {"token": separator_text, "id": separator_id},
        "shard_tokens": shard_tokens,
        "val_fraction": val_fraction,
        "splits": {
            name: {"tokens": sum(s["tokens"] for s in split.shards), "shards": split.shards}
            for name, split in splits.items()
        },
    }
    with written(out / "meta.json", "metadata", PREPARE_AGAIN) as partial:
        partial.write_text(json.dumps(meta, indent=2))
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m project.cli.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="text, .jsonl or .parquet files, or dirs of them")
    parser.add_argument("--out", type=Path, required=True, help="the dir for the shards, meta.json, tokenizer.json")
    parser.add_argument("--tokenizer", type=Path, help="a Hugging Face tokenizer.json (default: train a BPE)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="the trained BPE's vocabulary (default 8192)")
    parser.add_argument("--separator", help="the token after each document (default: <|endoftext|> or the like)")
    parser.add_argument("--text-key", default="text", help="the text field of .jsonl lines and .parquet rows")
    parser.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 1e8)")
    parser.add_argument(
        "--val-fraction", type=float, default=0.005, help="share of documents kept for validation (0: none)"
    )
    args = parser.parse_args()
    meta = prepare(
        args.inputs,
        args.out,
        args.tokenizer,
        args.vocab_size,
        args.separator,
        args.text_key,
        args.shard_tokens,
        args.val_fraction,
    )
    counts = ", ".join(
        f"{name} {split['tokens']:,} tokens in {len(split['shards'])} shards" for name, split in meta["splits"].items()
    )
    print(f"{args.out}: {counts}; vocabulary {meta['vocab_size']:,} ({meta['dtype']}).")


if __name__ == "__main__":
    run_cli("python -m project.cli.prepare", main)
