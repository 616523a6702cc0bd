"""The seeds' ``LargeModel``: a stack of Linear layers with ReLU between them, as an ordered block sequence.

``MLP(10000, [5000, 1000], 10)`` is exactly the tutorial's LargeModel (Linear 10000→5000→1000→10 with ReLU).
"""

import math
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from project.models.sequence import BlockSequence
from project.options.option_types import PositiveInt


class MLP(BlockSequence):
    """Linear → ReLU blocks, then a Linear output block; ``blocks`` holds them in order.

    Like every model here it is ``head(blocks(stem(x)))``; for the MLP, stem and head do nothing.
    """

    def __init__(self, input_dim: PositiveInt, hidden_dims: Sequence[PositiveInt], num_classes: PositiveInt) -> None:
        super().__init__()
        widths = [input_dim, *hidden_dims]
        hidden = [nn.Sequential(nn.Linear(w_in, w_out), nn.ReLU()) for w_in, w_out in zip(widths, widths[1:])]
        self.stem = nn.Identity()
        self.blocks = nn.ModuleList([*hidden, nn.Linear(widths[-1], num_classes)])
        self.head = nn.Identity()

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """PyTorch's default for a Linear layer: weight and bias uniform in ±1/sqrt(fan_in)."""
        layer = cast(nn.Linear, self.get_submodule(name.rpartition(".")[0]))  # every parameter is a Linear's
        bound = 1 / math.sqrt(layer.in_features)
        tensor.uniform_(-bound, bound, generator=generator)
