"""Megatron-LM's GPT as it ran its published weak-scaling table (Narayanan et al., SC'21, Table 1), for
``benchmarks/step_time.py`` to plan those rows as they ran: Megatron-LM's GPT of 2021 (``megatron/model/
transformer.py``, ``fused_kernels/``, its default arguments) differs from this project's in ways that change
what a step moves:

- The layer norm. Megatron's (apex's ``MixedFusedLayerNorm``) reads and writes its input's half precision, so the
  norms' outputs that its tensor parallelism hands to the next block's projections, and their gradients, are 2
  bytes an element. This project's ``nn.LayerNorm`` under CUDA's autocast returns float32 (autocast runs
  ``layer_norm`` in float32): under ``bf16-mixed`` with FSDP, which computes in bf16, it casts its input up, writes
  float32 (which sequence parallelism gathers, and whose gradients it reduce-scatters, at 4 bytes an element) and
  each projection casts it back. ``MegatronLayerNorm`` is one kernel in the input's dtype.
- The attention. Megatron's wrote each head's sequence x sequence scores to memory: a batched matmul (its scale
  folded in), its fused causal softmax (half precision in and out), dropout on the probabilities, and a batched
  matmul with the values (``MegatronAttention``), where this project's flash attention never writes them.
- Dropout: 0.1 on the attention's probabilities and on each block's two outputs (``--attention-dropout``,
  ``--hidden-dropout``; the attention's output's in ``MegatronAttention``), where this project's GPT defaults to
  none (``model.net.dropout``).

Megatron of 2021 had no sequence parallelism: its tensor-parallel ranks all-reduced the row-parallel layers'
outputs and ran the norms, dropout and residual adds on the whole sequence, as ``benchmarks/step_time.py`` plans
its rows with tensor parallelism and no pipeline (``strategy.sequence_parallel=false``; with a pipeline, sequence
parallelism splits the stages' sends as Megatron's scatter/gather of them did). Left as this project runs them:
FSDP where Megatron all-reduced whole gradients (either hides behind the compute); the queries, keys and values
copied to heads-first (Megatron's sequence-first layout made views of them); its fused bias-dropout-add and
bias-GELU kernels (here each an op). Megatron's softmax kernel made the causal mask from the positions; aten's
masked softmax here reads it, a byte a score, forward and backward.
"""

import torch
from torch import nn
from torch.nn import functional as F

from project.models import GPT
from project.models.gpt import CausalSelfAttention
from project.models.kv_cache import LayerCache
from project.parallel.tensor_parallel_plans import PLANS


class MegatronLayerNorm(nn.LayerNorm):
    """apex's ``MixedFusedLayerNorm``: one kernel forward and one backward, reading and writing its input's dtype
    (autocast's float32 layer norm set aside)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = (None if p is None else p.to(x.dtype) for p in (self.weight, self.bias))
        with torch.autocast("cuda" if x.is_cuda else "cpu", enabled=False):  # a plan's tensors may be meta
            return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


# aten's masked softmax has no meta kernel, with which a pipeline's plan infers its stages' shapes: each output is
# shaped as its first input.
_META_KERNELS = torch.library.Library("aten", "IMPL")
_META_KERNELS.impl("_masked_softmax", lambda scores, *_: torch.empty_like(scores), "Meta")
_META_KERNELS.impl("_masked_softmax_backward", lambda grad, *_: torch.empty_like(grad), "Meta")


class MegatronAttention(CausalSelfAttention):
    """Megatron's attention of 2021 (the module docstring): the scores and probabilities in memory, in half
    precision (autocast's float32 softmax set aside, as Megatron's fused kernel kept fp16), dropout on both the
    probabilities and the output."""

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        if cache is not None:
            raise NotImplementedError("Megatron's attention is planned for training steps only")
        batch, length, _ = x.shape
        q, k, v = (
            projection(x).view(batch, length, -1, self.head_dim).transpose(1, 2).flatten(0, 1)
            for projection in (self.q, self.k, self.v)
        )
        # Megatron's batched matmul wrote the scores with the scale folded in (baddbmm, beta 0, which the plan would
        # charge a read of its unread buffer): here the queries scaled first, a pass over them, not the scores
        scores = torch.bmm(q * self.head_dim**-0.5, k.transpose(1, 2))
        future = torch.ones(length, length, dtype=torch.bool, device=x.device).triu(1).expand(q.shape[0], -1, -1)
        with torch.autocast("cuda" if x.is_cuda else "cpu", enabled=False):  # a plan's tensors may be meta
            # one kernel forward and one backward, as Megatron's fused causal softmax (aten's masked softmax)
            probabilities = torch._masked_softmax(scores, future, -1, 2)
            probabilities = F.dropout(probabilities, self.dropout, self.training)
        y = torch.bmm(probabilities, v).view(batch, -1, length, self.head_dim)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(batch, length, -1)), self.dropout, self.training)


class MegatronGPT(GPT):
    """``GPT`` with Megatron's layer norms and attention."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for module in self.modules():
            if type(module) is nn.LayerNorm:
                module.__class__ = MegatronLayerNorm
            elif type(module) is CausalSelfAttention:
                module.__class__ = MegatronAttention


# Split by tensor parallelism as this project's GPT is (the same layers, named alike): the table every model's plan
# is registered in.
PLANS[MegatronGPT] = PLANS[GPT]

# The overrides that plan a row with Megatron's model and its dropout (benchmarks/ on sys.path).
AS_MEGATRON_RAN = ["model.net._target_=megatron_gpt.MegatronGPT", "model.net.dropout=0.1"]
