"""Prompts for online RL: ``data=prompts data.path=<.jsonl file or dir>`` (``experiment=grpo``,
``project/tasks/grpo.py``).

Each line is one prompt in TRL's prompt-only format: ``{"prompt": "..."}`` (text, tokenized as text with the
tokenizer's own special tokens, no chat template, as TRL's ``GRPOTrainer`` tokenizes it) or ``{"prompt": [messages]}``
(rendered with the model dir's chat template and its generation prompt). Every other key of a line is a column the
reward functions are handed by name (``project.tasks.rewards``). A line that is not JSON, has no prompt or an empty
one, or a prompt as long as ``data.seq_length`` is refused with its file and line before any worker starts; that the
prompts leave room for ``model.grpo.max_completion_length`` is the task's rule (it knows that key).

A batch is ``(inputs, target)``: inputs (prompts, seq_length) the prompts' tokens, each followed by padding; the target
(prompts, 2): each prompt's token count and its index in the file (``index_column``), which keys its text and columns
(``PromptDataModule.prompt_at``).
"""

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from project.data.records import Messages, check_message_fields, json_object, line_refusal, read_lines
from project.data.templated import PAD_ID, TemplatedDataModule, validation_count
from project.options.errors import ConfigError

_bad_prompt = line_refusal('{"prompt": "..."} or {"prompt": [{"role": "user", "content": "..."}]}, other keys free')


class PromptDataset(Dataset):
    """Prompts ``first + i`` as a batch: their padded tokens, and (token count, index) each."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, first: int) -> None:
        self.inputs, self.targets, self.first = inputs, targets, first

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, prompts: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.as_tensor(prompts, dtype=torch.long)
        return self.inputs[rows], torch.stack([self.targets[rows], rows + self.first], 1)


class PromptDataModule(TemplatedDataModule):
    """Prompts (module docstring); the last ``val_fraction`` of them (file order) are the validation split."""

    index_column = True

    def read(self, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor, int, str]:
        renderer, seq_length = self.renderer, self.seq_length
        self.records: list[tuple[str, str | Messages, dict[str, Any]]] = []  # where, the prompt as given, columns
        token_ids = []
        for where, line in read_lines(self.path):
            record = json_object(where, line, _bad_prompt)
            if "prompt" not in record:
                raise _bad_prompt(where, f"has no prompt (its keys: {sorted(record)})")
            prompt = record.pop("prompt")
            if isinstance(prompt, str):
                if not prompt.strip():
                    raise _bad_prompt(where, "has an empty prompt")
                ids = renderer.tokenizer.encode(prompt).ids  # TRL: the tokenizer's special tokens, no template
            elif isinstance(prompt, list) and prompt:
                check_message_fields(where, prompt, _bad_prompt, label="prompt ")
                with renderer._template_failure(where):
                    text = renderer.template.render(prompt, add_generation_prompt=True)
                ids = renderer.tokenizer.encode(text, add_special_tokens=False).ids
            else:
                raise _bad_prompt(
                    where, "has an empty prompt" if prompt in ([], "") else "has a prompt of neither text nor messages"
                )
            if len(ids) >= seq_length:
                raise ConfigError(
                    "data.path",
                    f"{where}: the prompt is {len(ids)} tokens, which leaves no completion token within "
                    f"data.seq_length = {seq_length}.",
                    "shorten the prompt, or raise data.seq_length.",
                )
            self.records.append((where, prompt, record))
            token_ids.append(ids)
        if not token_ids:
            raise ConfigError("data.path", f"{self.path} holds no prompt (its .jsonl lines are empty).", "add some.")
        num_val = validation_count(self.path, len(token_ids), val_fraction, "prompts")
        inputs = torch.full((len(token_ids), seq_length), PAD_ID, dtype=torch.long)
        for row, ids in enumerate(token_ids):
            inputs[row, : len(ids)] = torch.tensor(ids)
        lengths = torch.tensor([len(ids) for ids in token_ids])
        conversational = sum(not isinstance(prompt, str) for _, prompt, _ in self.records)
        summary = (
            f"Prompts: {len(token_ids)} from {self.path} ({len(token_ids) - num_val} training, {num_val} validation; "
            f"{conversational} as messages), {int(lengths.min())} to {int(lengths.max())} tokens."
        )
        return inputs, lengths, num_val, summary

    def split(self, inputs: torch.Tensor, targets: torch.Tensor, first: int) -> Dataset:
        return PromptDataset(inputs, targets, first)

    def prompt_at(self, index: int) -> tuple[str, str | Messages, dict[str, Any]]:
        """The ``index``-th prompt of the file: where it is, the prompt as given (text or messages), its columns."""
        return self.records[index]

    @functools.cached_property
    def stop_tokens(self) -> set[int]:
        """The tokens a completion ends at (kept): the template's end of turn and the tokenizer's end of sequence."""
        renderer = self.renderer
        eos = renderer.template.special_tokens.get("eos_token")
        tokens = (
            renderer.template.end_of_turn(renderer.tokenizer),
            None if eos is None else renderer.tokenizer.token_to_id(eos),
        )
        return {token for token in tokens if token is not None}

    @property
    def longest_prompt(self) -> tuple[int, str]:
        """The most tokens a prompt has, and where that prompt is."""
        row = int(self.targets.argmax())
        return int(self.targets[row]), self.records[row][0]

    def fingerprint(self) -> str:
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:
        digest = hashlib.sha256()
        digest.update(self.inputs.numpy().data)
        return digest.hexdigest()

    def task_problem(self, task: str, sequences_per_sample: int) -> ConfigError | None:
        """Prompts alone have no target to learn from: no task trained on given targets can use them (GRPO, which
        makes its own, checks its data itself)."""
        return ConfigError(
            "data", f"is prompts alone, which {task} cannot train on: they are for GRPO.", "add experiment=grpo."
        )
