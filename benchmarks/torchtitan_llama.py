"""torchtitan's Llama 3 as it ran its published rows, for ``benchmarks/step_time.py`` to plan them as they ran.

torchtitan's performance page names the code its H100 tables ran: its commit 9dec370 of 2024-12-26 (the model and
loss as at d4c86e375, which published the page). Its A100 tables ran its code of April 2024. Both differ from this
project's in ways that change what a step moves, each kept here as it was (``torchtitan/models/llama/model.py``,
``torchtitan/models/norms.py``, ``train.py`` and ``train_configs/``):

- RoPE in complex numbers: each query and key cast to float32, viewed as complex64, multiplied by the positions'
  complex frequencies, viewed back and cast to bf16. Inductor generates no code for complex numbers: compiled, the
  multiply runs as ATen's own kernel in float32, forward and backward, where this project's rotation fuses into its
  neighbours. (Both versions.)
- Keys and values repeated to every query head (``repeat_kv``) before attention, where this project's attention
  takes the grouped heads as they are (``enable_gqa``). (Both.)
- The loss not compiled ("compiling loss function causes CUDA errors, turning off for now" at 9dec370; April 2024's
  compiled nothing but the blocks): the float32 copy of the logits and their log-softmax written and read eagerly.
- The norms: 9dec370's configs chose ``norm_type = "rmsnorm"``, torchtitan's own RMSNorm, op by op in float32
  (eager, a kernel an op; compiled, fused like any other); April 2024's ``fused_rmsnorm``, a Triton kernel forward
  and one backward, as ``nn.RMSNorm`` runs on a GPU, but in its input's dtype (``norm_type``). Both return bf16
  where this project's norm under CUDA's autocast (torch 2.13's) returns float32.

Only what a step costs is kept: the weights' layout (torchtitan rotates adjacent pairs, this project each head's
two halves) and initialisation are this project's, which change no cost.
"""

import torch
from torch import nn
from torch.nn import functional as F

from project.models.kv_cache import LayerCache
from project.models.llama import Attention, Llama, rope_frequencies
from project.parallel.tensor_parallel_plans import PLANS
from project.tasks.language_model import LanguageModelModule


def _repeated(x: torch.Tensor, times: int) -> torch.Tensor:
    """torchtitan's ``repeat_kv``: (batch, length, kv heads, width) to (batch, length, kv heads x times, width)."""
    if times == 1:
        return x
    batch, length, heads, width = x.shape
    return x.unsqueeze(3).expand(batch, length, heads, times, width).reshape(batch, length, heads * times, width)


def _rotated(x: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``apply_rotary_emb`` of ``x`` (batch, length, heads, width) by ``frequencies`` (length,
    width / 2, complex64)."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * frequencies.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)


class TorchtitanAttention(Attention):
    """``Attention`` as torchtitan computed it (the module docstring): the same projections and heads."""

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        if cache is not None:
            raise NotImplementedError("torchtitan's attention is planned for training steps only")
        batch, length, _ = x.shape
        q, k, v = (projection(x).view(batch, length, -1, self.head_dim) for projection in (self.q, self.k, self.v))
        # torchtitan precomputes these once (a buffer each block takes as an input); a few small kernels here
        angles = torch.outer(
            torch.arange(length, device=x.device, dtype=torch.float32),
            rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling, x.device),
        )
        frequencies = torch.polar(torch.ones_like(angles), angles)
        q, k = _rotated(q, frequencies), _rotated(k, frequencies)
        times = q.shape[2] // k.shape[2]
        k, v = _repeated(k, times), _repeated(v, times)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o(y.transpose(1, 2).contiguous().view(batch, length, -1))


class TorchtitanRMSNorm(nn.RMSNorm):
    """torchtitan's ``RMSNorm`` (``norm_type = "rmsnorm"``): normalised in float32 op by op, then scaled."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class TorchtitanFusedRMSNorm(nn.RMSNorm):
    """torchtitan's ``FusedRMSNorm`` (``norm_type = "fused_rmsnorm"``): one kernel forward and one backward, in its
    input's dtype (where CUDA's autocast would run ``rms_norm`` in float32 on torch 2.13)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda" if x.is_cuda else "cpu", enabled=False):  # a plan's tensors may be meta
            weight = None if self.weight is None else self.weight.to(x.dtype)
            return F.rms_norm(x, self.normalized_shape, weight, self.eps)


NORMS = {"rmsnorm": TorchtitanRMSNorm, "fused_rmsnorm": TorchtitanFusedRMSNorm}


class TorchtitanLlama(Llama):
    """``Llama`` (Llama 3's: no query or key norms, no biases) with torchtitan's attention in every block and its
    ``norm_type``'s norms (``NORMS``)."""

    def __init__(self, norm_type: str = "fused_rmsnorm", **kwargs) -> None:
        super().__init__(**kwargs)
        if norm_type not in NORMS:
            raise ValueError(f"norm_type {norm_type!r}: torchtitan's rows ran one of {sorted(NORMS)}")
        for block in self.blocks:
            block.attention.__class__ = TorchtitanAttention
        for module in self.modules():
            if type(module) is nn.RMSNorm:
                module.__class__ = NORMS[norm_type]


# Split by tensor parallelism as this project's Llama is (the same projections, named alike): the table every model's
# plan is registered in.
PLANS[TorchtitanLlama] = PLANS[Llama]


class TorchtitanLanguageModel(LanguageModelModule):
    """The task with torchtitan's loss of then: never compiled."""

    def compile_loss(self) -> None:
        pass

    def compiled_loss_module(self) -> nn.Module | None:
        return None


def as_torchtitan_ran(norm_type: str) -> list[str]:
    """The overrides that plan a row with torchtitan's model and loss, its norm ``norm_type`` (benchmarks/ on
    sys.path)."""
    return [
        "model._target_=torchtitan_llama.TorchtitanLanguageModel",
        "model.net._target_=torchtitan_llama.TorchtitanLlama",
        f"+model.net.norm_type={norm_type}",
    ]
