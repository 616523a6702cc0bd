"""Chat and instruction data: ``data=chat data.path=<.jsonl file or dir> data.tokenizer=<HF model dir>``.

Each line of a ``.jsonl`` file is a conversation, ``{"messages": [{"role": ..., "content": ...}, ...]}``, or a
prompt/response pair, ``{"prompt": ..., "response": ...}`` (a user turn and an assistant turn). Conversations are
rendered with the model dir's own chat template (``chat_template.jinja``, or ``tokenizer_config.json``'s
``chat_template``) as transformers renders it (the same sandboxed Jinja environment and helpers), tokenized with its
``tokenizer.json``, and trained on the assistant's tokens only: every other target is ``IGNORE_INDEX``.

Which characters are the assistant's: a template with ``{% generation %}`` blocks marks them itself (transformers'
``return_assistant_tokens_mask``, and the same characters here). For a template without (most), an assistant turn is
what the template adds after the conversation so far plus its generation prompt: the rendering of the conversation up
to and with that turn, less the rendering up to it with ``add_generation_prompt=True``; so the turn's end-of-turn
token is trained, and the model learns to stop. The tokens trained are those holding a span's first character to
its last, as transformers counts them.

Each conversation is one sequence, padded at its end to ``seq_length + 1`` tokens (or cut to it), not packed with
others: packing would let a conversation attend to the one before it, as this project's attention is plain causal
attention with no per-document mask. Padding sits after the conversation, where causal attention keeps it from
changing any trained position, and its targets are ignored.

The whole file is read, rendered and checked in ``__init__``, before any worker starts: a line that is not JSON, a
record with neither form, a message without a role or content, a conversation with no assistant turn, a template that
fails: each is refused with the file and line.
"""

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from tokenizers import Tokenizer
from torch.utils.data import Dataset, TensorDataset

from project.data.codecs import TokenizerCodec, read_tokenizer
from project.data.datamodule import InMemoryDataModule
from project.models.linear_cross_entropy import IGNORE_INDEX
from project.options.errors import ConfigError
from project.options.option_types import NonNegativeInt, OpenFraction, PositiveInt, Seed

GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
PAD_ID = 0  # what fills a sequence after its conversation: never a target, and causal attention hides it before


def read_records(path: Path) -> list[tuple[str, list[dict[str, str]]]]:
    """(``file:line``, messages) of every conversation in ``path`` (a ``.jsonl`` file, or a dir of them, in name
    order); ``ConfigError`` naming the file and line of the first malformed record."""
    records = [(where, _messages(where, line)) for where, line in read_lines(path)]
    if not records:
        raise ConfigError("data.path", f"{path} holds no conversation (its .jsonl lines are empty).", "add some.")
    return records


def read_lines(path: Path) -> Iterator[tuple[str, str]]:
    """(``file:line``, text) of every line with text in ``path`` (a ``.jsonl`` file, or a dir of them, in name
    order); ``ConfigError`` naming the file and line of one that is not UTF-8."""
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise ConfigError("data.path", f"{path} holds no .jsonl file.", "pass a .jsonl file or a dir of them.")
    for file in files:
        with open(file, "rb") as lines:
            for number, raw in enumerate(lines, start=1):
                where = f"{file}:{number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    raise ConfigError(
                        "data.path",
                        f"{where}: byte {error.start + 1} of the line is not UTF-8 ({error.reason}).",
                        "save the records as UTF-8 text.",
                    ) from None
                if line.strip():
                    yield where, line


def line_refusal(shapes: str) -> Callable[[str, str], ConfigError]:
    """The refusal of a line of ``data.path``: where it is, what is wrong, and the ``shapes`` a line may take."""

    def refuse(where: str, problem: str) -> ConfigError:
        return ConfigError("data.path", f"{where}: {problem}.", f"write each line as {shapes}.")

    return refuse


_bad_record = line_refusal(
    '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]} or '
    '{"prompt": "...", "response": "..."}'
)


def json_object(where: str, line: str, bad: Callable[[str, str], ConfigError]) -> dict[str, Any]:
    """The JSON object of a record's line; ``bad(where, problem)``'s error for a line that is not one."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise bad(where, f"is not JSON ({error.msg}, column {error.colno})") from None
    if not isinstance(record, dict):
        raise bad(where, f"is a JSON {type(record).__name__}, not an object")
    return record


def check_message_fields(
    where: str, messages: list[Any], bad: Callable[[str, str], ConfigError], label: str = ""
) -> None:
    """Each message has a role and text content; ``bad``'s error for the first that does not (``label``: which list
    of the record they are)."""
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(where, f"{label}message {index} has no role")
        if not isinstance(message.get("content"), str):
            raise bad(where, f"{label}message {index} ({message['role']}) has no text content")


def _messages(where: str, line: str) -> list[dict[str, str]]:
    record = json_object(where, line, _bad_record)
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "response" in record:
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    else:
        raise _bad_record(where, f"has keys {sorted(record)}, neither messages nor prompt and response")
    if not isinstance(messages, list) or not messages:
        raise _bad_record(where, "has an empty conversation (messages is not a non-empty list)")
    check_message_fields(where, messages, _bad_record)
    if not any(message["role"] == "assistant" for message in messages):
        raise _bad_record(where, "has no assistant message, so nothing to train on")
    return messages


def _special_token(value: Any) -> str | None:
    """A tokenizer_config.json special token: a string, or transformers' AddedToken dict with its ``content``."""
    return value.get("content") if isinstance(value, dict) else value


class ChatTemplate:
    """A model dir's chat template, compiled as transformers compiles it (``transformers.utils.chat_template_utils``:
    a sandboxed environment, trimmed blocks, its ``tojson``, ``raise_exception`` and ``strftime_now``, and the
    ``{% generation %}`` tag, which records the characters it renders), rendered with the dir's special tokens."""

    def __init__(self, model_dir: Path) -> None:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template_file = model_dir / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # several named templates: transformers renders the one named default
            template = next((item["template"] for item in template if item.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ConfigError(
                "data.tokenizer",
                f"{model_dir} has no chat template (neither chat_template.jinja nor tokenizer_config.json's).",
                "pass the dir of a chat model, or add its template as chat_template.jinja.",
            )
        self.generation_spans: list[tuple[int, int]] | None = None  # recorded while a rendering runs
        self._rendered: list[str] = []
        tracker = self

        class Generation(Extension):
            """``{% generation %}...{% endgeneration %}``: the characters it renders are the assistant's."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                line = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(line)

            def _generation(self, caller: Callable[[], str]) -> str:
                text = caller()
                if tracker.generation_spans is not None:
                    start = len("".join(tracker._rendered))
                    tracker.generation_spans.append((start, start + len(text)))
                return text

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
        )
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        self.has_generation_tags = GENERATION_TAG.search(template) is not None
        try:
            self.template = environment.from_string(template)
        except jinja2.TemplateSyntaxError as error:
            where = template_file if template_file.is_file() else f"{config_file}'s chat_template"
            raise ConfigError(
                "data.tokenizer",
                f"{where}, line {error.lineno}: the chat template does not parse ({error.message}).",
                "fix the template, or use a model dir whose template transformers can render.",
            ) from None
        special = {**config, **self._special_tokens_map(model_dir)}
        names = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
        self.special_tokens = {
            name: token for name in names if (token := _special_token(special.get(name))) is not None
        }

    @staticmethod
    def _special_tokens_map(model_dir: Path) -> dict[str, Any]:
        path = model_dir / "special_tokens_map.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    @contextmanager
    def _tracking(self, spans: list[tuple[int, int]]):
        self.generation_spans, self._rendered = spans, []
        try:
            yield
        finally:
            self.generation_spans = None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.render_with_spans(messages, add_generation_prompt)[0]

    def render_with_spans(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its ``{% generation %}`` blocks."""
        spans: list[tuple[int, int]] = []
        with self._tracking(spans):
            for block in self.template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            ):
                self._rendered.append(block)
        return "".join(self._rendered), spans

    def end_of_turn(self, tokenizer: Tokenizer) -> int | None:
        """The token the template ends an assistant turn with (``<|im_end|>``, ``<|eot_id|>``, ``<|end|>``...): the
        first after a turn's text; None if it ends with none."""
        marker = "\x00turn\x00"
        text = self.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}])
        after = text[text.index(marker) + len(marker) :] if marker in text else ""
        ids = tokenizer.encode(after, add_special_tokens=False).ids
        return ids[0] if ids else None

    def assistant_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its assistant turns (module docstring). ``ValueError``
        for a template that does not render a conversation as the renderings of its beginnings continued."""
        text, spans = self.render_with_spans(messages)
        if self.has_generation_tags:
            return text, spans
        spans = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self.render(messages[:index], add_generation_prompt=True)
            through = self.render(messages[: index + 1])
            if not (through.startswith(prompt) and text.startswith(through)):
                raise ValueError(
                    f"the chat template renders message {index} (assistant) differently once later messages follow, "
                    "so its tokens cannot be told from the rest"
                )
            spans.append((len(prompt), len(through)))
        return text, spans


def trained_mask(tokenizer: Tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """``text``'s token ids and whether each is the assistant's: from the token holding a span's first character to
    the one holding its last, as transformers' ``return_assistant_tokens_mask`` counts them."""
    encoding = tokenizer.encode(text, add_special_tokens=False)
    mask = [False] * len(encoding.ids)
    for start, end in spans:
        if start >= end:  # an empty turn: no character of the assistant's
            continue
        first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
        if first is None:
            break
        for index in range(first, len(mask) if last is None else last + 1):
            mask[index] = True
    return encoding.ids, mask


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


class TemplatedDataModule(InMemoryDataModule):
    """Conversations rendered with a model dir's tokenizer and chat template (``data.tokenizer``): what ``data=chat``
    and ``data=preference`` share, and what ``generate --chat`` renders a prompt with. A subclass's ``read`` reads
    the records at ``path``, whole, when the module is built: before any worker starts."""

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
        self.path, self.tokenizer_dir, self.seq_length = Path(path), Path(tokenizer), seq_length
        self.tokenizer = _tokenizer(self.tokenizer_dir)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab_size not in (None, self.vocab_size):
            raise ConfigError(
                "data.vocab_size",
                f"is {vocab_size}, but {self.tokenizer_dir}/tokenizer.json has a vocabulary of {self.vocab_size}.",
                "leave data.vocab_size unset: it comes from the tokenizer.",
            )
        self.template = ChatTemplate(self.tokenizer_dir)
        # Every sample's inputs and targets, how many of the last are the validation split, and what setup says of
        # them (when training sets the data up: the checks before launch build the module too).
        self.inputs, self.targets, self.num_val, self.summary = self.read(val_fraction)

    def read(self, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor, int, str]:
        """(inputs, targets, validation samples, a summary line) of the records at ``path``."""
        raise NotImplementedError

    def rendered(self, where: str, messages: list[dict[str, str]], untrained: int = 0) -> tuple[list[int], list[bool]]:
        """A conversation's token ids and whether each is an assistant's, its first ``untrained`` assistant turns
        left out; ``ConfigError`` naming the record's ``where`` for a template that fails on it."""
        try:
            text, spans = self.template.assistant_spans(messages)
        except Exception as error:  # jinja2's TemplateError, or a template's own exception
            raise ConfigError(
                "data.path",
                f"{where}: the chat template of {self.tokenizer_dir} fails on it ({error}).",
                "fix the record, or use a model dir whose template renders it.",
            ) from None
        return trained_mask(self.tokenizer, text, spans[untrained:])

    def validation_count(self, count: int, val_fraction: float, kind: str, which: str = "") -> int:
        """How many of ``count`` samples (``kind``: conversations, pairs; ``which``: those kept) are the validation
        split; ``ConfigError`` unless both splits get one."""
        num_val = int(count * val_fraction)
        if num_val < 1 or count - num_val < 1:
            raise ConfigError(
                "data.val_fraction" if count >= 2 else "data.path",
                f"leaves {count - num_val} training and {num_val} validation {kind} of the {count} in "
                f"{self.path}{which}.",
                f"use more {kind}{', a longer data.seq_length' if which else ''}, or a data.val_fraction giving each "
                "split one.",
            )
        return num_val

    def sequence_tensors(self, sequences: list[tuple[list[int], list[bool]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs: each sequence but its last token, then padding to ``seq_length``; targets: the next token where it
        is trained, else ``IGNORE_INDEX``."""
        inputs = torch.full((len(sequences), self.seq_length), PAD_ID, dtype=torch.long)
        targets = torch.full((len(sequences), self.seq_length), IGNORE_INDEX, dtype=torch.long)
        for row, (ids, mask) in enumerate(sequences):
            tokens, trained = torch.tensor(ids), torch.tensor(mask)
            inputs[row, : len(ids) - 1] = tokens[:-1]
            targets[row, : len(ids) - 1] = torch.where(trained[1:], tokens[1:], IGNORE_INDEX)
        return inputs, targets

    @property
    def num_train_samples(self) -> int:
        return len(self.inputs) - self.num_val

    @property
    def num_val_samples(self) -> int:
        return self.num_val

    def text_codec(self) -> TokenizerCodec:
        return TokenizerCodec(self.tokenizer_dir / "tokenizer.json")

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


class ChatDataModule(TemplatedDataModule):
    """Conversations as (inputs, targets) of ``seq_length`` tokens, targets ``IGNORE_INDEX`` but for the assistant's
    tokens; the last ``val_fraction`` of the conversations (in file order) are the validation split."""

    def read(self, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor, int, str]:
        seq_length = self.seq_length
        sequences, truncated = [], 0
        for where, messages in read_records(self.path):
            ids, mask = self.rendered(where, messages)
            truncated += len(ids) > seq_length + 1
            sequences.append((ids[: seq_length + 1], mask[: seq_length + 1]))
        kept = [(ids, mask) for ids, mask in sequences if any(mask[1:])]  # a target of the assistant's to train
        within = f" with an assistant token within data.seq_length + 1 = {seq_length + 1} tokens"
        num_val = self.validation_count(len(kept), val_fraction, "conversations", within)
        inputs, targets = self.sequence_tensors(kept)
        summary = (
            f"Chat data: {len(kept)} conversations from {self.path} ({len(kept) - num_val} training, {num_val} "
            f"validation); {truncated} cut to {seq_length + 1} tokens, {len(sequences) - len(kept)} left out with "
            f"no assistant token within them; {int((targets != IGNORE_INDEX).sum()):,} trained tokens."
        )
        return inputs, targets, num_val, summary
