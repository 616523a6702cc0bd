"""The data's text <-> token codecs: what a language model's tokens mean as text (bytes, or a Hugging Face
tokenizer), for prompts and samples."""

from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer

from project.options.errors import ConfigError


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, tokens: list[int]) -> str: ...


class BytesCodec:
    """data=text: each byte is a token."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


def read_tokenizer(path: str | Path, key: str, fix: str) -> Tokenizer:
    """A Hugging Face ``tokenizer.json``, or ``ConfigError`` naming the option ``key`` that gave it."""
    try:
        return TokenizerCodec(path).tokenizer
    except ValueError as error:
        raise ConfigError(key, f"{error}.", fix) from None


class TokenizerCodec:
    """data=shards: the Hugging Face tokenizer the corpus was prepared with (its ``tokenizer.json``)."""

    def __init__(self, path: str | Path) -> None:
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception ("expected ident at line 1...")
            reason = "no such file" if not Path(path).is_file() else str(error)
            raise ValueError(f"{path} is not a tokenizer file Hugging Face tokenizers can read ({reason})") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)
