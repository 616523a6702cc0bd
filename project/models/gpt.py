"""A GPT-style decoder: token + position embedding, pre-norm transformer blocks, final norm, LM head.

Read top to bottom: ``CausalSelfAttention`` and ``MLP`` make a ``Block``; ``GPT`` is ``head(blocks(stem(tokens)))``,
the same stem / blocks / head shape as the other models, so strategies shard or split it by block. Its initial
weights are GPT-2's scheme (``GPT.init_parameter``), drawn parameter by parameter from the seed.
"""

import math
from typing import Literal

import torch
from torch import nn
from torch.nn import functional as F

from project.models.kv_cache import LayerCache
from project.models.linear_cross_entropy import LOGITS_PER_CHUNK, linear_cross_entropy
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.options.option_types import PositiveInt, Probability


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. The heads are counted from the projections' outputs, so a module whose
    projections compute only some of them (a tensor-parallel rank's) attends over those."""

    def __init__(self, dim: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """``cache``: the keys and values of the positions before ``x``'s, extended with ``x``'s (generation)."""
        batch, length, _ = x.shape
        start = 0 if cache is None else cache.length
        q, k, v = (
            projection(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
            for projection in (self.q, self.k, self.v)
        )
        if cache is not None:
            k, v = cache.extend(k, v)
        dropout = self.dropout if self.training else 0.0
        # After a cache's first pass, one token sees every position before it: no mask.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=start == 0)
        return self.proj(y.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    """``gelu_approximate``: ``none`` for the exact GELU (erf), ``tanh`` for GPT-2's approximation of it."""

    def __init__(self, dim: int, dropout: float, gelu_approximate: str = "none") -> None:
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout)
        self.gelu_approximate = gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x), approximate=self.gelu_approximate)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, num_heads: int, dropout: float, gelu_approximate: str = "none") -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = CausalSelfAttention(dim, num_heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, dropout, gelu_approximate)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), cache=cache)
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab_size: int, max_length: int, dim: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(max_length, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``start``: the first token's position (after a key/value cache's)."""
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self.dropout(self.tokens(tokens) + self.positions(positions))


class LMHead(nn.Module):
    """Final norm (LayerNorm unless given) and the projection to vocabulary logits; given the targets, the summed
    token loss of those logits instead, without the logits ever whole (``linear_cross_entropy``, at most
    ``logits_per_chunk`` of them at a time, each chunk's work compiled if ``compiled_loss``)."""

    logits_per_chunk = LOGITS_PER_CHUNK
    compiled_loss = False  # each chunk's work under torch.compile (model.compile)

    def __init__(self, dim: int, vocab_size: int, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        if target is None:
            return self.output(self.norm(x))
        return linear_cross_entropy(self.norm(x), self.output.weight, target, self.logits_per_chunk, self.compiled_loss)


class GPT(BlockSequence):
    """Decoder-only transformer mapping token ids (batch, length) to next-token logits (batch, length, vocab)."""

    def __init__(
        self,
        vocab_size: PositiveInt,
        max_length: PositiveInt,
        num_layers: PositiveInt,
        dim: PositiveInt,
        num_heads: PositiveInt,
        dropout: Probability = 0.0,
        tie_weights: bool = False,
        gelu_approximate: Literal["none", "tanh"] = "none",  # tanh: GPT-2's approximation, for GPT-2 weights
    ) -> None:
        super().__init__()
        if dim % num_heads:
            raise ConfigError(
                "model.net.num_heads",
                f"is {num_heads}, which does not divide model.net.dim={dim}.",
                "choose a head count that divides the width (each head gets dim / num_heads).",
            )
        self.stem = Embedding(vocab_size, max_length, dim, dropout)
        self.blocks = nn.ModuleList(Block(dim, num_heads, dropout, gelu_approximate) for _ in range(num_layers))
        self.head = LMHead(dim, vocab_size)
        if tie_weights:  # GPT-2's choice: the output projection reuses the token embedding
            self.head.output.weight = self.stem.tokens.weight
        self.num_layers = num_layers
        self.max_positions = max_length

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """GPT-2's initialisation: weights and embeddings normal with std 0.02, the residual projections scaled
        down by sqrt(2 x layers) so the residual stream does not grow with depth; biases 0, norms 1 and 0."""
        module = self.get_submodule(name.rpartition(".")[0])
        if isinstance(module, nn.LayerNorm):
            tensor.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            tensor.zero_()
        elif name.endswith(("proj.weight", "down.weight")):
            tensor.normal_(0.0, 0.02 / math.sqrt(2 * self.num_layers), generator=generator)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
