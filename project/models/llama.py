"""A Llama-style decoder (Llama 3 and Mistral; Qwen 2 with biased query, key and value projections; Qwen 3 with
its queries and keys normalised per head): token embedding, pre-norm blocks of grouped-query attention with rotary
position embeddings (RoPE) and a SwiGLU MLP, RMSNorm; a final norm and the LM head.

Read top to bottom: ``rope_frequencies`` and ``rotate`` place positions in the queries and keys; ``Attention`` and
``SwiGLU`` make a ``Block``; ``Llama`` is ``head(blocks(stem(tokens)))``, the stem / blocks / head shape of the other
models, so strategies shard or split it by block. The rotation follows Hugging Face's layout (the two halves of each
head rotate together), so its checkpoints load without permuting (``project.checkpointing.hf``).
"""

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from project.models.gpt import LMHead
from project.models.kv_cache import LayerCache
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.options.option_types import PositiveFloat, PositiveInt


def rope_frequencies(
    head_dim: int, theta: float, scaling: dict | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """The rotation frequency of each pair of a head's dimensions, (head_dim / 2,) in float32, on ``device``.

    ``scaling``: Llama 3.1's long-context rule (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_length``): wavelengths longer than the original context divided by ``factor``, those shorter
    than it / ``high_freq_factor`` kept, and the ones between interpolated.
    """
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    if scaling is None:
        return frequencies
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_length"]
    wavelengths = 2 * math.pi / frequencies
    scaled = torch.where(wavelengths > original / low, frequencies / factor, frequencies)
    smooth = (original / wavelengths - low) / (high - low)
    between = (wavelengths >= original / high) & (wavelengths <= original / low)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rotate(x: torch.Tensor, frequencies: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Rotate each head's (i, i + head_dim / 2) pairs of ``x`` (batch, heads, length, head_dim) by position x
    frequency, the angles in float32; ``start``: the first row's position (after a key/value cache's)."""
    positions = torch.arange(start, start + x.shape[2], device=x.device, dtype=torch.float32)
    angles = torch.outer(positions, frequencies)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


@dataclass(frozen=True)
class HeadOptions:
    """How a block's attention heads are made: their counts and width, the projections' biases, the norms."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool  # Qwen 2: biases on the query, key and value projections (not the output's)
    qk_norm: bool  # Qwen 3: each query and key head RMS-normalised before the rotation
    norm_eps: float


class Attention(nn.Module):
    """Causal self-attention with ``num_kv_heads`` key/value heads shared by groups of the ``num_heads`` query heads
    (grouped-query attention; equal counts are plain multi-head attention)."""

    def __init__(self, dim: int, heads: HeadOptions, rope: tuple[float, dict | None]) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, heads.head_dim
        self.q = nn.Linear(dim, heads.num_heads * heads.head_dim, bias=heads.qkv_bias)
        self.k = nn.Linear(dim, heads.num_kv_heads * heads.head_dim, bias=heads.qkv_bias)
        self.v = nn.Linear(dim, heads.num_kv_heads * heads.head_dim, bias=heads.qkv_bias)
        self.o = nn.Linear(heads.num_heads * heads.head_dim, dim, bias=False)
        # Over each head's width, one weight shared by every head (so a tensor-parallel rank's heads use it too).
        self.q_norm = nn.RMSNorm(heads.head_dim, eps=heads.norm_eps) if heads.qk_norm else None
        self.k_norm = nn.RMSNorm(heads.head_dim, eps=heads.norm_eps) if heads.qk_norm else None
        # Checked here, where Llama's and the mixture's blocks both take it: a degenerate rule gives NaN frequencies
        self.rope_theta, self.rope_scaling = rope[0], rope_scaling_checked(rope[1])

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """``cache``: the keys and values of the positions before ``x``'s, extended with ``x``'s (generation)."""
        batch, length, _ = x.shape
        start = 0 if cache is None else cache.length
        # -1: the heads the projections computed (all of them, or a tensor-parallel rank's share, in proportion).
        q, k, v = (projection(x).view(batch, length, -1, self.head_dim) for projection in (self.q, self.k, self.v))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        # Computed for each call, on the input's device: a buffer would need initialising after meta-device
        # construction in every strategy, and these few small kernels cost next to attention nothing.
        frequencies = rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling, x.device)
        q, k = rotate(q, frequencies, start), rotate(k, frequencies, start)
        if cache is not None:
            k, v = cache.extend(k, v)
        # After a cache's first pass, one token sees every position before it: no mask.
        causal = start == 0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o(y.transpose(1, 2).reshape(batch, length, -1))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden_dim, bias=False)
        self.up = nn.Linear(dim, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x)); the MLP a ``SwiGLU`` (or, in a
    mixture of experts, ``project.models.moe.Experts``)."""

    def __init__(self, dim: int, heads: HeadOptions, rope: tuple[float, dict | None], mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=heads.norm_eps)
        self.attention = Attention(dim, heads, rope)
        self.norm2 = nn.RMSNorm(dim, eps=heads.norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), cache=cache)
        return x + self.mlp(self.norm2(x))


class TokenEmbedding(nn.Module):
    """Token ids to vectors; positions enter through the attention's rotation."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        return self.tokens(tokens)


def head_options(
    dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None,
    qkv_bias: bool,
    qk_norm: bool,
    norm_eps: float,
) -> HeadOptions:
    """The attention heads of ``model.net``'s options, checked: ``ConfigError`` naming the key that cannot work."""
    if head_dim is None and dim % num_heads:
        raise ConfigError(
            "model.net.num_heads",
            f"is {num_heads}, which does not divide model.net.dim={dim} into heads.",
            "choose a head count that divides dim, or set model.net.head_dim.",
        )
    if qk_norm and qkv_bias:
        raise ConfigError(
            "model.net.qkv_bias",
            "is true with model.net.qk_norm=true: no Hugging Face family has both, so no dir could hold it.",
            "set one of them (qkv_bias: Qwen 2; qk_norm: Qwen 3).",
        )
    width = head_dim or dim // num_heads
    if width % 2:
        raise ConfigError(
            "model.net.head_dim" if width != dim // num_heads else "model.net.num_heads",
            f"gives heads of {width} dimensions, an odd number.",
            "choose heads of an even width: RoPE rotates their dimensions in pairs.",
        )
    if num_heads % num_kv_heads:
        raise ConfigError(
            "model.net.num_kv_heads",
            f"is {num_kv_heads}, which does not divide model.net.num_heads={num_heads}.",
            "choose a divisor of num_heads: each key/value head serves an equal group of query heads.",
        )
    return HeadOptions(num_heads, num_kv_heads, width, qkv_bias, qk_norm, norm_eps)


ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_length")


def rope_scaling_checked(scaling: dict | None) -> dict | None:
    """``model.net.rope_scaling``: null, or Llama 3.1's rule with each key a positive number, ``factor`` at least 1
    and ``high_freq_factor`` above ``low_freq_factor`` (``rope_frequencies`` divides by their difference: a
    degenerate rule gives NaN frequencies, and a run that diverges at once for no reason a learning rate fixes)."""
    if not scaling:
        return None
    problem = _rope_scaling_problem(scaling)
    if problem is not None:
        raise ConfigError(
            "model.net.rope_scaling",
            f"{problem} ({dict(scaling)}).",
            "use Llama 3.1's {factor: 8, low_freq_factor: 1, high_freq_factor: 4, original_max_length: 8192} "
            "(a preset's), or null for none.",
        )
    return dict(scaling)


def _rope_scaling_problem(scaling: dict) -> str | None:
    missing = [key for key in ROPE_SCALING_KEYS if scaling.get(key) is None]
    if missing:
        return f"lacks {', '.join(missing)}"
    values = [scaling[key] for key in ROPE_SCALING_KEYS]
    if not all(isinstance(value, int | float) and not isinstance(value, bool) and value > 0 for value in values):
        return "has a value that is not a positive number"
    factor, low, high, _ = values
    if factor < 1:
        return f"has factor {factor}, below 1"
    if high <= low:
        return f"has high_freq_factor {high}, not above low_freq_factor {low}"
    return None


class Llama(BlockSequence):
    """Decoder-only transformer mapping token ids (batch, length) to next-token logits (batch, length, vocab).

    ``rope_scaling``: null, or Llama 3.1's long-context frequency rule (``rope_frequencies``). ``max_length`` is
    the context the model is meant for (RoPE itself has no limit); exported as Hugging Face's
    ``max_position_embeddings``. ``head_dim``: each head's width, ``dim / num_heads`` when null (Qwen 3's are
    wider). ``qkv_bias`` and ``qk_norm``: Qwen 2's and Qwen 3's departures from Llama (``HeadOptions``).
    """

    def __init__(
        self,
        vocab_size: PositiveInt,
        max_length: PositiveInt,
        num_layers: PositiveInt,
        dim: PositiveInt,
        num_heads: PositiveInt,
        num_kv_heads: PositiveInt,
        hidden_dim: PositiveInt,
        rope_theta: PositiveFloat = 500000.0,
        rope_scaling: dict | None = None,
        norm_eps: PositiveFloat = 1e-5,
        tie_weights: bool = False,
        head_dim: PositiveInt | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        heads = head_options(dim, num_heads, num_kv_heads, head_dim, qkv_bias, qk_norm, norm_eps)
        rope = (rope_theta, rope_scaling)
        self.stem = TokenEmbedding(vocab_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, rope, SwiGLU(dim, hidden_dim)) for _ in range(num_layers))
        self.head = LMHead(dim, vocab_size, nn.RMSNorm(dim, eps=norm_eps))
        if tie_weights:  # Llama 3.2's small models: the output projection reuses the token embedding
            self.head.output.weight = self.stem.tokens.weight
        self.num_layers = num_layers

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Weights and embeddings normal with std 0.02, the residual projections (attention output, MLP down)
        scaled down by sqrt(2 x layers) so the residual stream does not grow with depth; norms 1, biases 0."""
        init_decoder_parameter(self, name, tensor, generator, ("attention.o.weight", "mlp.down.weight"))


def init_decoder_parameter(
    model: BlockSequence, name: str, tensor: torch.Tensor, generator: torch.Generator, residual: tuple[str, ...]
) -> None:
    """A Llama-style decoder's initial value of parameter ``name``: normal with std 0.02, the projections into the
    residual stream (names ending in ``residual``) scaled down by sqrt(2 x blocks); norms 1, biases 0."""
    module = model.get_submodule(name.rpartition(".")[0])
    if isinstance(module, nn.RMSNorm):
        tensor.fill_(1.0)
    elif name.endswith(".bias"):
        tensor.zero_()
    elif name.endswith(residual):
        tensor.normal_(0.0, 0.02 / math.sqrt(2 * len(model.blocks)), generator=generator)
    else:
        tensor.normal_(0.0, 0.02, generator=generator)
