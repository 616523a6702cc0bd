"""Preference pairs for DPO: ``data=preference data.path=<.jsonl file or dir>`` (``experiment=dpo``,
``project/tasks/dpo.py``).

Each line is one pair in TRL's preference format (``project.data.records``: its forms, and the refusal of a
malformed one with its file and line). Each pair is tokenized as TRL's ``DPOTrainer`` tokenizes it: given as
messages, the prompt is rendered with the model dir's chat template and its generation prompt, and the prompt with
each response rendered whole (``ChatRenderer.conversational``); given as text, no template, the end-of-sequence token
appended to each response (``ChatRenderer.plain``). The tokens after the prompt's are the targets: the prompt (its
earlier assistant turns too) and the padding are ``IGNORE_INDEX``, and a response of several messages is trained
whole, the headers between them too, as TRL trains it. A pair longer than ``seq_length + 1`` tokens is cut at its
end, as TRL's ``max_length`` cuts (``keep_start``), and the log counts them once; a prompt that leaves no response
token within the length is refused.

A pair is one sample: its chosen and rejected sequences are rows ``2i`` and ``2i + 1`` of a batch's (inputs,
targets), so that every layout sees the plain (rows, length) batches of a language model and no data-parallel
split separates a pair. The targets' last column is each row's pair index in the file (validation after training,
``index_column``), which keys the reference's log-probabilities (``DPOModule``): it rides with its row wherever a
layout cuts the batch (a pipeline's micro-batches).
"""

import functools
import hashlib
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from project.data.records import RESPONSES, plain_pair, read_lines, read_pair
from project.data.templated import TemplatedDataModule, validation_count
from project.options.errors import ConfigError


class PairDataset(Dataset):
    """Pairs ``first + i`` as a batch of rows: indexed with the pairs' indices (``GlobalBatchSampler``'s batches), the
    inputs and targets of their sequences, chosen then rejected for each, the targets with each row's pair index as
    their last column."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, first: int) -> None:
        self.inputs, self.targets, self.first = inputs, targets, first  # (pairs, 2, seq_length) each

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, pairs: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.as_tensor(pairs, dtype=torch.long)
        indices = (rows + self.first).repeat_interleave(len(RESPONSES))
        return self.inputs[rows].flatten(0, 1), torch.cat([self.targets[rows].flatten(0, 1), indices[:, None]], 1)


class PreferenceDataModule(TemplatedDataModule):
    """Preference pairs (module docstring); the last ``val_fraction`` of them (in file order) are the validation
    split. ``inputs`` and ``targets``: (pairs, 2, seq_length), chosen then rejected."""

    sequences_per_sample = len(RESPONSES)  # what the memory plan and the step-time model run a sample as
    index_column = True

    def read(self, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor, int, str]:
        seq_length, renderer = self.seq_length, self.renderer
        pairs, truncated, alike = [], 0, 0
        for where, line in read_lines(self.path):
            prompt, *responses = read_pair(where, line)
            alike += responses[0] == responses[1]
            texts = plain_pair(line)
            if texts is not None:  # TRL's standard format: text, no chat template
                rendered = renderer.plain(texts[0], texts[1:])
            else:
                rendered = renderer.conversational(where, prompt, responses)
            sequences = []
            for key, (ids, mask) in zip(RESPONSES, rendered, strict=True):
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
        num_val = validation_count(self.path, len(pairs), val_fraction, "pairs")
        inputs, targets = renderer.rows([sequence for pair in pairs for sequence in pair])
        summary = (
            f"Preference data: {len(pairs)} pairs from {self.path} ({len(pairs) - num_val} training, {num_val} "
            f"validation); {truncated} of their {2 * len(pairs)} responses cut to {seq_length + 1} tokens."
        )
        if alike:  # legal, and almost surely not meant
            summary += (
                f" {alike} of the pairs have the same chosen and rejected response: their loss is log 2 whatever the "
                "model does, and they teach it nothing."
            )
        shape = (len(pairs), len(RESPONSES), seq_length)
        return inputs.view(shape), targets.view(shape), num_val, summary

    def split(self, inputs: torch.Tensor, targets: torch.Tensor, first: int) -> Dataset:
        return PairDataset(inputs, targets, first)

    def fingerprint(self) -> str:
        """A digest of every pair's tokens and targets."""
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:
        digest = hashlib.sha256()
        for tensor in (self.inputs, self.targets):
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.numpy().data)  # its buffer, not a copy
        return digest.hexdigest()

    def task_problem(self, task: str, sequences_per_sample: int) -> ConfigError | None:
        """A pair's rows are one sample: a task reading rows one by one would train on both responses alike."""
        if sequences_per_sample == self.sequences_per_sample:
            return None
        return ConfigError(
            "data",
            f"is preference pairs, which {task} cannot train on: they are for DPO.",
            "add experiment=dpo, or use data=chat for supervised fine-tuning.",
        )
