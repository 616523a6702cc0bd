"""What every Hugging Face family's adapter declares (``HFFamily``, one file each in this package): the names of its
tensors, those it fuses, transposes or splits per expert, how its ``config.json`` maps to ``model.net``'s options and
back, and which of this project's nets it writes. ``project.checkpointing.hf`` reads and writes model dirs with it.
"""

import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from project.models.sequence import BlockSequence
from project.options.errors import ConfigError

# A mixture's stacked expert projection here (one tensor per projection), one tensor per expert there.
EXPERT_PARAMETER = re.compile(r"^blocks\.(?P<i>\d+)\.mlp\.experts\.(?P<p>gate|up|down)$")
# The layer of a parameter that may be a part of a fused tensor: blocks.0.attention.q.weight -> q.
FUSED_NAME = re.compile(r"\.(?:attention|mlp)\.(\w+)\.(?:weight|bias)$")
# The special tokens are the tokenizer's business, which this project does not know: without these nulls,
# transformers would take its family defaults (GPT-2's 50256, Llama's 1 and 2) and stop generating at them.
NO_TOKEN_IDS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _pattern(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>\w+)")
    return re.compile(pattern.replace(r"\{n\}", r"(?P<n>[qk])") + "$")


def hydra_value(value: Any) -> str:
    """``value`` as a command-line override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{hydra_value(item)}" for key, item in value.items()) + "}"
    return str(value)


def variant(description: str) -> ConfigError:
    """The error for a model dir of a variant of its family this project's model cannot compute."""
    return ConfigError(
        "model.init_from",
        f"is a variant this project's model cannot compute: {description}.",
        "use a model of the standard shape of its family.",
    )


class HFFamily(ABC):
    """A Hugging Face model family (``config.json``'s ``model_type``) as this project reads and writes it: a table
    from this project's parameter names to the family's (``names``: ``{i}`` a block index, ``{p}`` a projection,
    ``{n}`` q or k), the net class that computes it, and what differs from a name-for-name copy."""

    model_type: ClassVar[str]
    model_group: ClassVar[str]  # the model group of its own presets, for messages (model=...)
    net_class: ClassVar[type[BlockSequence]]
    names: ClassVar[dict[str, str]]
    tied_input: ClassVar[str] = "model.embed_tokens.weight"  # lm_head's source when tied
    tied_by_default: ClassVar[bool] = False  # transformers' default for tie_word_embeddings
    # Parameters stored as parts of one Hugging Face tensor, stacked along its output features in this order.
    fused: ClassVar[list[tuple[str, ...]]] = []
    transposed: ClassVar[re.Pattern | None] = None  # the tensors it stores transposed (GPT-2's Conv1D)
    position_table: ClassVar[bool] = False  # learned positions, max_length of them: a longer sequence has none
    # A mixture's name of expert {e}'s projection {p} in block {i}, and its projections' names; None: no experts.
    experts: ClassVar[tuple[str, dict[str, str]] | None] = None

    @abstractmethod
    def net_options(self, config: dict[str, Any]) -> dict[str, Any]:
        """The ``model.net`` options that give ``config``'s model (the shape keys, by this project's name);
        ``ConfigError`` for a variant the net cannot compute; a ``KeyError`` for a key the config lacks."""

    @abstractmethod
    def writes(self, net: nn.Module, net_cfg: dict[str, Any]) -> bool:
        """Whether ``net`` (built from ``net_cfg``) is exported as this family (one family writes each net)."""

    @abstractmethod
    def hf_config(self, net_cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
        """The ``config.json`` of a net of this family built from ``net_cfg`` (``ConfigError`` for options the
        family does not compute)."""

    def sliding_window(self, config: dict[str, Any]) -> int | None:
        """The attention window of ``config``'s model as transformers reads it; None: every token sees the whole
        context (this project's attention)."""
        return None

    def part_rows(self, config: dict[str, Any]) -> dict[str, int]:
        """The rows of each part of a fused tensor (``fused``), from the model's config."""
        return {}

    def is_tied(self, config: dict[str, Any]) -> bool:
        """Whether the model's output layer is its token embedding."""
        return config.get("tie_word_embeddings", self.tied_by_default)

    def hf_name(self, name: str) -> str:
        """The family's name of this project's parameter ``name``."""
        for ours, theirs in self.names.items():
            match = _pattern(ours).match(name)
            if match:
                return theirs.format(**match.groupdict())
        raise KeyError(f"{name} has no Hugging Face name in the {self.model_type} family")

    def expert_keys(self, name: str, experts: range) -> list[str] | None:
        """The family's names of ``experts``' parts of this project's parameter ``name``, when it is a mixture's
        stacked expert projection; else None."""
        match = EXPERT_PARAMETER.match(name)
        if self.experts is None or match is None:
            return None
        template, projections = self.experts
        return [template.format(i=match["i"], e=e, p=projections[match["p"]]) for e in experts]

    def fused_part(self, name: str) -> tuple[int, tuple[str, ...]] | None:
        """(its place, the parts in order) when ``name`` is a part of a fused tensor of the family's."""
        match = FUSED_NAME.search(name)
        layer = match.group(1) if match else None
        return next(((parts.index(layer), parts) for parts in self.fused if layer in parts), None)

    def is_transposed(self, key: str) -> bool:
        """Whether the family stores tensor ``key`` (its own name) transposed."""
        return self.transposed is not None and self.transposed.search(key) is not None
