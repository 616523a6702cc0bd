"""The shape every model here has, and the one strategies act on: ``head(blocks(stem(x)))``."""

import torch
from torch import nn

from project.models.kv_cache import KeyValueCache


class BlockSequence(nn.Module):
    """A model as ``stem``, an ordered ``blocks`` list, and ``head``. FSDP shards it block by block; model_parallel
    and pipeline split ``blocks`` into stages, the stem with the first and the head with the last. Subclasses set
    the three parts and say how each parameter starts (``init_parameter``, see ``project.models.init``)."""

    stem: nn.Module
    blocks: nn.ModuleList
    head: nn.Module
    max_positions: int | None = None  # the longest sequence it takes (learned positions); None: any (rotary)

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        raise NotImplementedError

    def forward(
        self, x: torch.Tensor, target: torch.Tensor | None = None, cache: KeyValueCache | None = None
    ) -> torch.Tensor:
        """The head's output; given ``target``, what a head that takes the targets makes of them (a language
        model's ``LMHead``: the summed token loss, its logits never whole). ``cache``: a decoder's keys and values
        of the tokens before ``x``'s, which its blocks extend (generation)."""
        if cache is None:
            x = self.stem(x)
            for block in self.blocks:
                x = block(x)
        else:
            x = self.stem(x, cache.length)
            for block, layer in zip(self.blocks, cache.layers, strict=True):
                x = block(x, cache=layer)
        return self.head(x) if target is None else self.head(x, target)
