"""The output layer and the token loss in one: hidden states, the output weight and the targets give the summed
cross-entropy a chunk of tokens at a time, so that no (tokens, vocabulary) logits tensor exists whole, nor its
float32 copy, nor its gradient. With a 50k-128k vocabulary those are the largest tensors of a language model's step.

This is the algorithm of Liger-Kernel's fused linear cross-entropy in plain torch ops: Liger's Triton kernels run on
CUDA alone (not on the CPU this project is tested on) and are not on the GPU box; plain ops run everywhere, and the
memory plan and the step-time model simulate them as any other. Per chunk: the logits in the compute dtype (as the
output Linear would give them), their log-softmax in float32 (as ``cross_entropy`` takes them under autocast), and
at once the gradients of the chunk's hidden states and of the weight, since the loss ends the graph: backward only
scales them.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch

from project.data.targets import IGNORE_INDEX

# The most logits a chunk holds by default (model.fused_loss_chunk_logits): 2^28, a GiB in float32 (with the bf16
# logits, torch's float32 copy of them for the log-softmax and the bf16 gradient, about 3 GiB while a chunk is worked
# on). Not Liger's rule (a chunk's logits as many as all the hidden states: 63 chunks for Llama 3's
# vocabulary at 8 x 1024 tokens): each chunk reads and writes the weight's float32 gradient whole (1 GiB for
# Llama-3.2-1B's output layer), so that few large chunks cost the least traffic. The plain loss holds about 6x this.
LOGITS_PER_CHUNK = 2**28


def chunk_rows(rows: int, vocab: int, logits_per_chunk: int = LOGITS_PER_CHUNK) -> int:
    """Tokens per chunk: the largest power of two whose logits stay within ``logits_per_chunk`` (at least one
    token), or all ``rows`` where they fit."""
    fitting = 1 << max(0, (logits_per_chunk // vocab).bit_length() - 1)
    return max(1, min(fitting, rows))


def _chunk(
    rows: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, wide: torch.dtype, grads: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A chunk's summed loss and, with ``grads``, its hidden states' gradient and its share of the weight's."""
    log_probs = torch.log_softmax(rows @ w.T, dim=-1, dtype=wide)
    trained = targets != IGNORE_INDEX
    picked = targets.where(trained, 0)
    loss = -(log_probs.gather(1, picked[:, None]).squeeze(1) * trained).sum()
    if not grads:
        return loss, None, None
    # d(loss)/d(logits) = softmax - one-hot of the target, in the log-probabilities' place; the untrained rows' are
    # zeroed through the (tokens, dim) tensors either side of the matmuls, not the logits
    grad_logits = log_probs.exp_()
    grad_logits.scatter_add_(1, picked[:, None], -torch.ones_like(log_probs[:, :1]))
    grad, kept = grad_logits.to(rows.dtype), trained[:, None].to(rows.dtype)
    return loss, (grad @ w) * kept, grad.T @ (rows * kept)


@functools.cache
def _compiled_chunk() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """``_chunk`` under ``torch.compile`` (``model.compile``): inductor fuses its passes over the chunk's logits
    (the float32 log-softmax, the softmax, the one-hot, the cast) around the matmuls. Made once, on first use."""
    return torch.compile(_chunk)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        chunk: int,
        dtype: torch.dtype,
        compiled: bool,
    ) -> torch.Tensor:
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]
        h, w = hidden.to(dtype), weight.to(dtype)
        wide = torch.promote_types(dtype, torch.float32)  # the softmax's and the sums' dtype: float32 at least
        total = torch.zeros((), dtype=wide, device=hidden.device)
        grad_h = torch.empty_like(h) if needs_hidden else None
        grad_w = torch.zeros(weight.shape, dtype=wide, device=weight.device) if needs_weight else None
        step = _compiled_chunk() if compiled else _chunk
        for start in range(0, h.shape[0], chunk):
            rows = slice(start, start + chunk)
            loss, rows_grad, weight_grad = step(h[rows], w, target[rows], wide, needs_hidden or needs_weight)
            total += loss
            if grad_h is not None and rows_grad is not None:
                grad_h[rows] = rows_grad
            if grad_w is not None and weight_grad is not None:
                grad_w += weight_grad
        ctx.hidden_dtype = hidden.dtype
        ctx.save_for_backward(
            grad_h if grad_h is not None else torch.empty(0),
            grad_w.to(weight.dtype) if grad_w is not None else torch.empty(0),
        )
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        needs_hidden, needs_weight = ctx.needs_input_grad[:2]
        return (
            (grad_h * grad_output).to(ctx.hidden_dtype) if needs_hidden else None,
            grad_w * grad_output.to(grad_w.dtype) if needs_weight else None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    logits_per_chunk: int = LOGITS_PER_CHUNK,
    compiled: bool = False,
) -> torch.Tensor:
    """The summed cross-entropy of ``hidden @ weight.T`` against ``target`` (its ``IGNORE_INDEX`` positions left
    out): ``hidden`` (..., dim), ``weight`` (vocab, dim), ``target`` of hidden's leading shape. Equal to
    ``F.cross_entropy(F.linear(hidden, weight), target, reduction="sum")``, under autocast too (the logits in
    autocast's dtype, the softmax in float32), computed ``chunk_rows`` tokens at a time, each chunk's work under
    ``torch.compile`` if ``compiled``. Without grad mode (an evaluation) the loss alone: the gradients it would
    compute in its forward are left out."""
    device = hidden.device.type
    dtype = (
        torch.get_autocast_dtype(device)
        if torch.is_autocast_enabled(device)
        else torch.promote_types(hidden.dtype, weight.dtype)
    )
    rows = hidden.reshape(-1, hidden.shape[-1])
    if not torch.is_grad_enabled():  # the Function's needs_input_grad follows requires_grad, not grad mode
        rows, weight = rows.detach(), weight.detach()
    step = chunk_rows(rows.shape[0], weight.shape[0], logits_per_chunk)
    with torch.autocast(device, enabled=False):  # the dtypes are chosen above, as autocast would
        return _LinearCrossEntropy.apply(rows, weight, target.reshape(-1).to(hidden.device), step, dtype, compiled)
