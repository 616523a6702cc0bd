"""The ``.jsonl`` records of ``data=chat`` and ``data=preference``, read whole before any worker starts: each line's
JSON, its form, its messages; a malformed one refused with its file and line (``ConfigError`` on ``data.path``).

- a conversation (``data=chat``): ``{"messages": [{"role": ..., "content": ...}, ...]}``, or a prompt/response pair,
  ``{"prompt": ..., "response": ...}`` (a user turn and an assistant turn), with at least one assistant turn;
- a preference pair (``data=preference``), in TRL's preference format: conversational,
  ``{"prompt": [messages], "chosen": [assistant messages], "rejected": [assistant messages]}``, or plain,
  ``{"prompt": "...", "chosen": "...", "rejected": "..."}`` (a user turn, and an assistant turn each).
"""

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from project.options.errors import ConfigError

Messages = list[dict[str, str]]
RESPONSES = ("chosen", "rejected")  # a preference pair's two responses, in the order its rows take


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


_bad_conversation = line_refusal(
    '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]} or '
    '{"prompt": "...", "response": "..."}'
)


def read_conversations(path: Path) -> list[tuple[str, Messages]]:
    """(``file:line``, messages) of every conversation in ``path`` (a ``.jsonl`` file, or a dir of them, in name
    order); ``ConfigError`` naming the file and line of the first malformed record."""
    records = [(where, _conversation(where, line)) for where, line in read_lines(path)]
    if not records:
        raise ConfigError("data.path", f"{path} holds no conversation (its .jsonl lines are empty).", "add some.")
    return records


def _conversation(where: str, line: str) -> Messages:
    record = json_object(where, line, _bad_conversation)
    if "messages" in record:
        messages = record["messages"]
    elif "prompt" in record and "response" in record:
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    else:
        raise _bad_conversation(where, f"has keys {sorted(record)}, neither messages nor prompt and response")
    if not isinstance(messages, list) or not messages:
        raise _bad_conversation(where, "has an empty conversation (messages is not a non-empty list)")
    check_message_fields(where, messages, _bad_conversation)
    if not any(message["role"] == "assistant" for message in messages):
        raise _bad_conversation(where, "has no assistant message, so nothing to train on")
    return messages


_bad_pair = line_refusal(
    '{"prompt": [{"role": "user", "content": "..."}], "chosen": [{"role": "assistant", "content": "..."}], '
    '"rejected": [...]} or {"prompt": "...", "chosen": "...", "rejected": "..."}'
)


def read_pair(where: str, line: str) -> tuple[Messages, Messages, Messages]:
    """The prompt's messages and the chosen and rejected responses' messages of one line."""
    record = json_object(where, line, _bad_pair)
    missing = [key for key in ("prompt", *RESPONSES) if key not in record]
    if missing:
        raise _bad_pair(where, f"has no {' and no '.join(missing)} (its keys: {sorted(record)})")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    responses = []
    for key in RESPONSES:
        response = record[key]
        if isinstance(response, str):
            response = [{"role": "assistant", "content": response}]
        _check_pair_messages(where, key, response)
        role = next((message["role"] for message in response if message["role"] != "assistant"), None)
        if role is not None:
            raise _bad_pair(where, f"has a {role} message in its {key} response, which is the assistant's alone")
        if not any(str(message["content"]).strip() for message in response):
            blank = any(message["content"] for message in response)
            raise _bad_pair(where, f"has {'a blank (whitespace only)' if blank else 'an empty'} {key} response")
        responses.append(response)
    _check_pair_messages(where, "prompt", prompt)
    return prompt, responses[0], responses[1]


def plain_pair(line: str) -> tuple[str, str, str] | None:
    """A checked pair's prompt, chosen and rejected texts, where the line gives all three as text (TRL's standard,
    not conversational, format: tokenized as text, not rendered by a chat template); else None."""
    record = json.loads(line)
    texts = tuple(record[key] for key in ("prompt", *RESPONSES))
    return texts if all(isinstance(text, str) for text in texts) else None  # type: ignore[return-value]


def _check_pair_messages(where: str, key: str, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad_pair(where, f"{key} is neither text nor a non-empty list of messages")
    check_message_fields(where, messages, _bad_pair, label=f"{key} ")
