"""Conversations as token rows: a model dir's tokenizer and chat template (``data.tokenizer``) render each one
(``ChatRenderer``), and ``TemplatedDataModule`` holds the rows, what ``data=chat`` and ``data=preference`` share.

Each conversation is one sequence, padded at its end to ``seq_length + 1`` tokens (or cut to it), not packed with
others: packing would let a conversation attend to the one before it, as this project's attention is plain causal
attention with no per-document mask. Padding sits after the conversation, where causal attention keeps it from
changing any trained position, and its targets are ``IGNORE_INDEX``: only the assistant's tokens are trained.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from lightning.pytorch.utilities import rank_zero_info
from tokenizers import Tokenizer
from torch.utils.data import Dataset, TensorDataset

from project.data.chat_template import ChatTemplate, trained_mask
from project.data.codecs import TokenizerCodec, read_tokenizer
from project.data.datamodule import DataModule
from project.data.records import Messages
from project.data.targets import IGNORE_INDEX
from project.options.errors import ConfigError
from project.options.option_types import NonNegativeInt, OpenFraction, PositiveInt, Seed

PAD_ID = 0  # what fills a sequence after its conversation: never a target, and causal attention hides it before

# A sequence's token ids and whether each is the assistant's (trained).
Sequence = tuple[list[int], list[bool]]


def tokenizer_vocab_size(model_dir: str | None) -> int:
    """data=chat: the vocabulary of a model dir's ``tokenizer.json``, added tokens included."""
    if model_dir is None:
        raise ConfigError(
            "data.tokenizer",
            "is null: with no model.init_from, no dir gives the conversations their tokenizer and chat template.",
            "set model.init_from=<a Hugging Face model dir>, or data.tokenizer=<the dir of the tokenizer to use>.",
        )
    return _tokenizer(Path(model_dir)).get_vocab_size(with_added_tokens=True)


def _tokenizer(model_dir: Path) -> Tokenizer:
    return read_tokenizer(model_dir / "tokenizer.json", "data.tokenizer", "pass a Hugging Face model dir with one.")


class ChatRenderer:
    """A model dir's tokenizer and chat template (``model_dir``, ``data.tokenizer``): conversations rendered into
    token ids with their assistant tokens marked (``rendered``), and rows of ``seq_length`` tokens (``rows``)."""

    def __init__(self, model_dir: Path, seq_length: int, vocab_size: int | None) -> None:
        self.model_dir, self.seq_length = model_dir, seq_length
        self.tokenizer = _tokenizer(model_dir)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab_size not in (None, self.vocab_size):
            raise ConfigError(
                "data.vocab_size",
                f"is {vocab_size}, but {model_dir}/tokenizer.json has a vocabulary of {self.vocab_size}.",
                "leave data.vocab_size unset: it comes from the tokenizer.",
            )
        self.template = ChatTemplate(model_dir)

    def rendered(self, where: str, messages: Messages) -> Sequence:
        """A conversation's token ids and whether each is an assistant's."""
        with self._template_failure(where):
            text, spans = self.template.assistant_spans(messages)
        return trained_mask(self.tokenizer, text, spans)

    def conversational(self, where: str, prompt: Messages, responses: list[Messages]) -> list[Sequence]:
        """Responses to a prompt given as messages, tokenized as TRL's ``DPOTrainer`` (1.16) tokenizes them: the
        prompt rendered with the template's generation prompt and the prompt followed by each response rendered, each
        response trained from where those renderings' tokens first differ (``_after_prompt``). A response of several
        messages is trained whole, the headers between its messages too, as TRL trains it."""
        with self._template_failure(where):
            prompt_text = self.template.render(prompt, add_generation_prompt=True)
            texts = [self.template.render(prompt + response) for response in responses]
        encode = self.tokenizer.encode
        return _after_prompt(
            encode(prompt_text, add_special_tokens=False).ids,
            [encode(text, add_special_tokens=False).ids for text in texts],
        )

    def plain(self, prompt: str, responses: tuple[str, ...]) -> list[Sequence]:
        """Responses to a prompt given as text, tokenized as TRL's ``DPOTrainer`` (1.16) tokenizes them: each response
        with the tokenizer's end-of-sequence token appended (unless it ends with it), the prompt and the prompt
        followed by each response encoded as text (the tokenizer's own special tokens added, no chat template), each
        response trained from where those encodings first differ (``_after_prompt``)."""
        eos = self.template.special_tokens.get("eos_token")
        if eos is None:
            raise ConfigError(
                "data.tokenizer",
                f"{self.model_dir} names no eos_token, which TRL appends to every response given as text.",
                "pass a model dir whose tokenizer_config.json names one, or give the pairs as messages.",
            )
        whole = [self.tokenizer.encode(prompt + (text if text.endswith(eos) else text + eos)).ids for text in responses]
        return _after_prompt(self.tokenizer.encode(prompt).ids, whole)

    @contextmanager
    def _template_failure(self, where: str) -> Iterator[None]:
        """``ConfigError`` naming the record's ``where`` for a template that fails on it."""
        try:
            yield
        except Exception as error:  # jinja2's TemplateError, a template's own exception, assistant_spans' ValueError
            raise ConfigError(
                "data.path",
                f"{where}: the chat template of {self.model_dir} fails on it ({error}).",
                "fix the record, or use a model dir whose template renders it.",
            ) from None

    def rows(self, sequences: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_rows`` of ``seq_length`` tokens."""
        return token_rows(sequences, self.seq_length)


def token_rows(sequences: list[Sequence], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs: each sequence but its last token, then padding to ``width``; targets: the next token where it is
    trained, else ``IGNORE_INDEX``."""
    inputs = torch.full((len(sequences), width), PAD_ID, dtype=torch.long)
    targets = torch.full((len(sequences), width), IGNORE_INDEX, dtype=torch.long)
    for row, (ids, mask) in enumerate(sequences):
        tokens, trained = torch.tensor(ids), torch.tensor(mask)
        inputs[row, : len(ids) - 1] = tokens[:-1]
        targets[row, : len(ids) - 1] = torch.where(trained[1:], tokens[1:], IGNORE_INDEX)
    return inputs, targets


def _after_prompt(prompt_ids: list[int], whole: list[list[int]]) -> list[Sequence]:
    """Each of ``whole`` (the prompt and a response, tokenized together) trained from the first token where any of
    them differs from ``prompt_ids``, as TRL's ``DPOTrainer`` starts each completion: a token merging across the
    prompt's end, or a template rendering the prompt alone differently, belongs to the responses."""
    start = min(_common_prefix(prompt_ids, ids) for ids in whole)
    return [(ids, [False] * start + [True] * (len(ids) - start)) for ids in whole]


def _common_prefix(ids: list[int], other: list[int]) -> int:
    """How many leading tokens ``ids`` and ``other`` share."""
    return next((index for index, (a, b) in enumerate(zip(ids, other)) if a != b), min(len(ids), len(other)))


def validation_count(path: Path, count: int, val_fraction: float, kind: str, which: str = "") -> int:
    """How many of the ``count`` samples read from ``path`` (``kind``: conversations, pairs; ``which``: those kept)
    are the validation split; ``ConfigError`` unless both splits get one."""
    num_val = int(count * val_fraction)
    if num_val < 1 or count - num_val < 1:
        raise ConfigError(
            "data.val_fraction" if count >= 2 else "data.path",
            f"leaves {count - num_val} training and {num_val} validation {kind} of the {count} in {path}{which}.",
            f"use more {kind}{', a longer data.seq_length' if which else ''}, or a data.val_fraction giving each "
            "split one.",
        )
    return num_val


class TemplatedDataModule(DataModule):
    """Conversations rendered by ``data.tokenizer``'s tokenizer and chat template (``renderer``), and what
    ``generate --chat`` renders a prompt with. A subclass's ``read`` makes every sample's rows from the records at
    ``path`` with the renderer, whole, when the module is built: before any worker starts."""

    seq_length: int
    vocab_size: int

    def __init__(
        self,
        path: str,
        tokenizer: str,
        seq_length: PositiveInt,
        val_fraction: OpenFraction,
        batch_size: PositiveInt,
        seed: Seed,
        shuffle: bool = True,
        num_workers: NonNegativeInt = 0,
        vocab_size: PositiveInt | None = None,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, shuffle=shuffle, num_workers=num_workers)
        if not Path(path).exists():
            raise ConfigError("data.path", f"{path} does not exist.", "pass a .jsonl file or a dir of them.")
        self.path, self.seq_length = Path(path), seq_length
        self.renderer = ChatRenderer(Path(tokenizer), seq_length, vocab_size)
        self.vocab_size = self.renderer.vocab_size
        # Every sample's inputs and targets, how many of the last are the validation split, and what setup says of
        # them (when training sets the data up: the checks before launch build the module too).
        self.inputs, self.targets, self.num_val, self.summary = self.read(val_fraction)

    def read(self, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor, int, str]:
        """(inputs, targets, validation samples, a summary line) of the records at ``path``."""
        raise NotImplementedError

    @property
    def num_train_samples(self) -> int:
        return len(self.inputs) - self.num_val

    @property
    def num_val_samples(self) -> int:
        return self.num_val

    def text_codec(self) -> TokenizerCodec:
        return TokenizerCodec(self.renderer.model_dir / "tokenizer.json")

    def split(self, inputs: torch.Tensor, targets: torch.Tensor, first: int) -> Dataset:
        """The dataset of the samples ``first`` on of ``inputs`` and ``targets`` (a split of them)."""
        return TensorDataset(inputs, targets)

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        rank_zero_info(self.summary)
        start = self.num_train_samples
        self.train_set = self.split(self.inputs[:start], self.targets[:start], first=0)
        self.val_set = self.split(self.inputs[start:], self.targets[start:], first=start)
