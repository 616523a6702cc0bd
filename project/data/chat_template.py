"""A model dir's chat template, rendered as transformers renders it, and which tokens of a rendered conversation are
the assistant's.

Templates are compiled as transformers compiles them (``transformers.utils.chat_template_utils``: the same sandboxed
Jinja environment and helpers). Which characters are the assistant's: a template with ``{% generation %}`` blocks
marks them itself (transformers' ``return_assistant_tokens_mask``, and the same characters here). For a template
without (most), an assistant turn is what the template adds after the conversation so far plus its generation prompt:
the rendering of the conversation up to and with that turn, less the rendering up to it with
``add_generation_prompt=True``; so the turn's end-of-turn token is trained, and the model learns to stop. The tokens
trained are those holding a span's first character to its last, as transformers counts them.
"""

import json
import re
from collections.abc import Callable
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from project.options.errors import ConfigError

GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


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
