"""Chat and instruction data: ``data=chat data.path=<.jsonl file or dir> data.tokenizer=<HF model dir>``.

Each line of a ``.jsonl`` file is a conversation (``project.data.records``: its forms, and the refusal of a malformed
one with its file and line), rendered with the model dir's own chat template (``chat_template.jinja``, or
``tokenizer_config.json``'s ``chat_template``) as transformers renders it (``project.data.chat_template``), tokenized
with its ``tokenizer.json``, and trained on the assistant's tokens only: every other target is ``IGNORE_INDEX``
(``project.data.templated``: one padded row per conversation).

The whole file is read, rendered and checked when the module is built, before any worker starts: a line that is not
JSON, a record with neither form, a message without a role or content, a conversation with no assistant turn, a
template that fails: each is refused with the file and line.
"""

import torch

from project.data.records import read_conversations
from project.data.targets import IGNORE_INDEX
from project.data.templated import TemplatedDataModule, validation_count


class ChatDataModule(TemplatedDataModule):
    """Conversations as (inputs, targets) of ``seq_length`` tokens, targets ``IGNORE_INDEX`` but for the assistant's
    tokens; the last ``val_fraction`` of the conversations (in file order) are the validation split."""

    def read(self, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor, int, str]:
        seq_length, renderer = self.seq_length, self.renderer
        sequences, truncated = [], 0
        for where, messages in read_conversations(self.path):
            ids, mask = renderer.rendered(where, messages)
            truncated += len(ids) > seq_length + 1
            sequences.append((ids[: seq_length + 1], mask[: seq_length + 1]))
        kept = [(ids, mask) for ids, mask in sequences if any(mask[1:])]  # a target of the assistant's to train
        within = f" with an assistant token within data.seq_length + 1 = {seq_length + 1} tokens"
        num_val = validation_count(self.path, len(kept), val_fraction, "conversations", within)
        inputs, targets = renderer.rows(kept)
        summary = (
            f"Chat data: {len(kept)} conversations from {self.path} ({len(kept) - num_val} training, {num_val} "
            f"validation); {truncated} cut to {seq_length + 1} tokens, {len(sequences) - len(kept)} left out with "
            f"no assistant token within them; {int((targets != IGNORE_INDEX).sum()):,} trained tokens."
        )
        return inputs, targets, num_val, summary
