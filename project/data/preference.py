"""Preference pairs for DPO: ``data=preference data.path=<.jsonl file or dir>`` (``experiment=dpo``,
``project/tasks/dpo.py``).

Each line is one pair in TRL's preference format: conversational,
``{"prompt": [messages], "chosen": [assistant messages], "rejected": [assistant messages]}``, or plain,
``{"prompt": "...", "chosen": "...", "rejected": "..."}`` (a user turn, and an assistant turn each). The prompt and
each response are rendered together with the model dir's chat template (``project.data.chat``), and only the
response's tokens are targets: the prompt's earlier assistant turns, the template's headers and the padding are
``IGNORE_INDEX``. A pair longer than ``seq_length + 1`` tokens is cut at its end, as TRL's ``max_length`` cuts
(``keep_start``), and the log counts them once; a prompt that leaves no response token within the length is refused.

A pair is one sample: its chosen and rejected sequences are rows ``2i`` and ``2i + 1`` of a batch's (inputs,
targets), so that every layout sees the plain (rows, length) batches of a language model and no data-parallel
split separates a pair; the batch's third tensor is the pairs' indices in the file (validation after training),
which key the reference's log-probabilities (``DPOModule``).
"""

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from project.data.chat import TemplatedDataModule, check_message_fields, json_object, line_refusal, read_lines
from project.options.errors import ConfigError

RESPONSES = ("chosen", "rejected")
Messages = list[dict[str, str]]


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
        _check_messages(where, key, response)
        role = next((message["role"] for message in response if message["role"] != "assistant"), None)
        if role is not None:
            raise _bad_pair(where, f"has a {role} message in its {key} response, which is the assistant's alone")
        if not any(message["content"] for message in response):
            raise _bad_pair(where, f"has an empty {key} response")
        responses.append(response)
    _check_messages(where, "prompt", prompt)
    return prompt, responses[0], responses[1]


def _check_messages(where: str, key: str, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad_pair(where, f"{key} is neither text nor a non-empty list of messages")
    check_message_fields(where, messages, _bad_pair, label=f"{key} ")


class PairDataset(Dataset):
    """Pairs ``first + i`` as a batch of rows: indexed with a list of pairs (``GlobalBatchSampler``'s batches), the
    inputs and targets of their sequences, chosen then rejected for each, and the pairs' indices."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, first: int) -> None:
        self.inputs, self.targets, self.first = inputs, targets, first  # (pairs, 2, seq_length) each

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, pairs: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = torch.as_tensor(pairs, dtype=torch.long)
        return self.inputs[rows].flatten(0, 1), self.targets[rows].flatten(0, 1), rows + self.first


class PreferenceDataModule(TemplatedDataModule):
    """Preference pairs (module docstring); the last ``val_fraction`` of them (in file order) are the validation
    split. ``inputs`` and ``targets``: (pairs, 2, seq_length), chosen then rejected."""

    sequences_per_sample = len(RESPONSES)  # what the memory plan and the step-time model run a sample as

    def read(self, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor, int, str]:
        seq_length = self.seq_length
        pairs, truncated = [], 0
        for where, line in read_lines(self.path):
            prompt, *responses = read_pair(where, line)
            sequences = []
            untrained = sum(message["role"] == "assistant" for message in prompt)  # the prompt's own turns
            for key, response in zip(RESPONSES, responses, strict=True):
                ids, mask = self.rendered(where, prompt + response, untrained)
                if not any(mask[1 : seq_length + 1]):
                    raise ConfigError(
                        "data.path",
                        f"{where}: the prompt leaves no token of the {key} response within data.seq_length + 1 = "
                        f"{seq_length + 1} tokens.",
                        "shorten the prompt, or raise data.seq_length.",
                    )
                truncated += len(ids) > seq_length + 1
                sequences.append((ids[: seq_length + 1], mask[: seq_length + 1]))
            pairs.append(sequences)
        if not pairs:
            raise ConfigError("data.path", f"{self.path} holds no pair (its .jsonl lines are empty).", "add some.")
        num_val = self.validation_count(len(pairs), val_fraction, "pairs")
        inputs, targets = self.sequence_tensors([sequence for pair in pairs for sequence in pair])
        summary = (
            f"Preference data: {len(pairs)} pairs from {self.path} ({len(pairs) - num_val} training, {num_val} "
            f"validation); {truncated} of their {2 * len(pairs)} responses cut to {seq_length + 1} tokens."
        )
        shape = (len(pairs), len(RESPONSES), seq_length)
        return inputs.view(shape), targets.view(shape), num_val, summary

    def split(self, inputs: torch.Tensor, targets: torch.Tensor, first: int) -> Dataset:
        return PairDataset(inputs, targets, first)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of every pair's tokens and targets: what a checkpoint's reference log-probabilities were of."""
        digest = hashlib.sha256()
        for tensor in (self.inputs, self.targets):
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.numpy().data)  # its buffer, not a copy
        return digest.hexdigest()
