"""The seeds' ``LargeModel``: a stack of Linear layers with ReLU between them, as an ordered block sequence.

``MLP(10000, [5000, 1000], 10)`` is exactly seed 000's model (Linear 10000→5000→1000→10 with ReLU).
"""

import math
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from project.config.errors import ConfigError, positive_int
from project.models.sequence import BlockSequence


class MLP(BlockSequence):
    """Linear → ReLU blocks, then a Linear output block; ``blocks`` holds them in order.

    Like every model here it is ``head(blocks(stem(x)))``; for the MLP, stem and head do nothing.
    """

    def __init__(self, input_dim: int, hidden_dims: Sequence[int], num_classes: int) -> None:
        super().__init__()
        if isinstance(hidden_dims, (str, bytes)) or not isinstance(hidden_dims, Sequence):
            raise ConfigError(
                "model.net.hidden_dims",
                f"must be a list of layer widths, got {hidden_dims!r}.",
                "give positive integers, e.g. model.net.hidden_dims=[1024,512].",
            )
        for width in hidden_dims:
            positive_int(
                "model.net.hidden_dims", width, "give positive integers, e.g. model.net.hidden_dims=[1024,512]."
            )
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
