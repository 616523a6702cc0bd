"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): fine-tune a model by training a
low-rank update beside chosen Linear layers of its blocks while every weight it already has stays frozen.

A target Linear ``W`` (``out x in``) becomes ``y = x W^T + b + dropout(x) A^T B^T * alpha / rank``, with ``A`` (rank x
in) and ``B`` (out x rank) the only parameters trained. As Hugging Face ``peft`` starts them (its ``LoraLayer``), ``A``
is Kaiming-uniform (a = sqrt(5), nn.Linear's own default) and ``B`` zero, so training starts from the model itself.
The layer stays an ``nn.Linear`` with its weight under its own name, so Hugging Face weights load into it, and the
adapters' names add ``lora_a`` and ``lora_b`` (``blocks.0.attn.q.lora_a.weight``).
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from project.models.nf4 import quantize_base
from project.models.sequence import BlockSequence


@dataclass(frozen=True)
class LoRA:
    """``model.lora``: the adapters' ``rank`` and ``alpha`` (the update is scaled by alpha / rank), the dropout on
    their input, the ``targets``: the names of the blocks' Linear layers that get one (``q``, ``v``...), and
    whether the frozen Linear weights of the blocks are stored in 4-bit NF4 (``quantize_base``: QLoRA,
    ``project.models.nf4``)."""

    rank: int
    alpha: float
    dropout: float
    targets: Sequence[str]
    quantize_base: bool = False


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (its weight and bias frozen: ``apply_lora``) plus a trainable low-rank update of it."""

    def __init__(self, base: nn.Linear, lora: LoRA) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device=base.weight.device)
        self.weight, self.bias = base.weight, base.bias  # the base's own parameters, frozen by apply_lora
        self.lora_a = nn.Linear(base.in_features, lora.rank, bias=False, device=base.weight.device)
        self.lora_b = nn.Linear(lora.rank, base.out_features, bias=False, device=base.weight.device)
        self.dropout = nn.Dropout(lora.dropout)
        self.scaling = lora.alpha / lora.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora_b(self.lora_a(self.dropout(x))) * self.scaling


def apply_lora(net: BlockSequence, lora: LoRA) -> list[str]:
    """Freeze every parameter of ``net`` and put an adapter on each Linear of its blocks named in ``lora.targets``
    (in place, on the meta device), the blocks' frozen Linear weights in NF4 with ``lora.quantize_base``; returns
    the names of the layers adapted."""
    for parameter in net.parameters():
        parameter.requires_grad_(False)
    adapted = []
    for index, block in enumerate(net.blocks):
        for name, module in list(block.named_modules()):
            if isinstance(module, nn.Linear) and name.rpartition(".")[2] in lora.targets:
                parent_name, _, child = name.rpartition(".")
                parent = block.get_submodule(parent_name) if parent_name else block
                setattr(parent, child, LoRALinear(module, lora))
                adapted.append(f"blocks.{index}.{name}")
    if lora.quantize_base:
        quantize_base(net)
    return adapted


def init_adapter(name: str, tensor: torch.Tensor, generator: torch.Generator) -> bool:
    """Give an adapter parameter its initial value as ``peft`` does (``A`` Kaiming-uniform, ``B`` zero); False for
    a parameter that is not an adapter's."""
    if name.endswith("lora_a.weight"):
        bound = 1 / math.sqrt(tensor.shape[1])  # kaiming_uniform_ with a = sqrt(5): sqrt(6 / (1 + 5) / fan_in)
        tensor.uniform_(-bound, bound, generator=generator)
        return True
    if name.endswith("lora_b.weight"):
        tensor.zero_()
        return True
    return False


def is_adapter(name: str) -> bool:
    return name.endswith(("lora_a.weight", "lora_b.weight"))


def merged(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """``state`` with each LoRA adapter folded into the weight it adapts (``W + B A scaling``, in float32) and the
    adapters gone."""
    state = dict(state)
    for name in [name for name in state if name.endswith(".lora_a.weight")]:
        layer = name.removesuffix(".lora_a.weight")
        a, b = state.pop(name).float(), state.pop(f"{layer}.lora_b.weight").float()
        weight = state[f"{layer}.weight"]
        state[f"{layer}.weight"] = (weight.float() + b @ a * scaling).to(weight.dtype)
    return state
