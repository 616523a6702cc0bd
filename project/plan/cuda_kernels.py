"""A simulated step as CUDA would run it (``cuda_kernels``), on the CPU's fake tensors.

A memory plan simulates a device's step on fake CPU tensors, whatever device the job runs on: this CPU-only build of
torch cannot make a CUDA tensor, not even a fake one. Where CUDA's kernels would keep other tensors than the CPU's,
the plan of a CUDA job would be off (four of six runs with activation checkpointing 12-14% over an H200's
``max_memory_allocated``, docs/gpu.md), so while simulating one this module makes the CPU behave as CUDA does in
the five ways that change what a step holds:

- **Autocast.** CUDA's mixed precision casts by other lists than the CPU's (``torch/include/ATen/autocast_mode.h``
  against ``aten/src/ATen/autocast_mode.cpp``'s CPU table). The difference that costs most: the CPU casts
  ``cross_entropy`` to float32 whole (its ``log_softmax``, and the gradient back through it, in float32), where
  CUDA runs ``log_softmax`` in the logits' bfloat16 and casts only ``nll_loss``'s input. CUDA's
  policy is registered here on the CPU's autocast key, op by op, for the ops whose policy differs.
- **Attention.** ``scaled_dot_product_attention`` runs CUDA's choice of kernel (flash attention in half precision,
  the memory-efficient kernel in float32, the math kernel where neither applies), with what that kernel saves for
  backward: the output and log-sum-exp (the CPU's kernel keeps the score matrix under dropout, flash does not).
- **RMSNorm.** CUDA runs ``rms_norm`` as one fused kernel, which saves its input and each row's reciprocal root;
  the CPU's composite also saves the normalised input in float32.
- **Dropout.** CUDA runs ``dropout`` as one kernel that writes its output and a mask of a byte an element; the
  CPU's composite draws a noise tensor in the input's dtype, scales it and multiplies, and saves the noise.
- **The caching allocator** rounds every block up to 512 bytes (``max_memory_allocated`` counts blocks); torch's
  ``MemTracker`` rounds so for CUDA tensors only, and here for the CPU's that stand in for them.

Left as the CPU runs them: autocast's cache of a parameter's cast is the CPU kernel's, kept for the ops both lists
cast to lower precision (linear, the matmuls, convolutions); the ops only CUDA's list casts (einsum, mv...) cast a
parameter at each call. The fused RMSNorm's forward computes as torch's decomposition, op by op.
"""

import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed._tools import mem_tracker
from torch.utils._pytree import tree_leaves, tree_map

# CUDA's autocast policy, by op (torch 2.13's torch/include/ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE), as the
# torch installed has it: 2.11's (the GPU boxes') runs rms_norm in the autocast dtype, not float32, and lists the
# named-dimension overloads of the float32-with-dtype ops, which 2.13 dropped (2.12 not checked: taken as 2.13).
# tests/test_cuda_kernels.py checks these lists against the installed torch's header and AutocastCUDA registrations.
_BEFORE_2_13 = torch.torch_version.TorchVersion(torch.__version__) < "2.13"
LOWER_PRECISION = [
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
]
FP32 = [
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    *([] if _BEFORE_2_13 else ["rms_norm"]),
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
]
FP32_SET_OPT_DTYPE = [
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
    *(
        ["prod.dim_Dimname", "softmax.Dimname", "log_softmax.Dimname", "cumprod.dimname", "cumsum.dimname"]
        + ["sum.dim_DimnameList"]
        if _BEFORE_2_13
        else []
    ),
]
PROMOTE = [
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
]
# norm without a dtype is redispatched to its overload with one, float32 (CUDA's fp32_append_dtype policy).
FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    **({"norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype"} if _BEFORE_2_13 else {}),
}
# CUDA's only other entries: its cuDNN convolutions (never called on a CPU) and binary_cross_entropy, which
# CUDA's autocast refuses (a run raises; the simulation keeps the CPU's float32 for it).
CUDA_ONLY = {"cudnn_convolution", "cudnn_convolution_transpose", "binary_cross_entropy"} | (
    {"_cudnn_rnn"} if _BEFORE_2_13 else set()
)
# The ops both tables list, with the same policy: the CPU's own kernel (its cast cache included) stays. Of the
# ops both list, only binary_cross_entropy, grid_sampler and prod differ (aten/src/ATen/autocast_mode.cpp).
SAME_ON_CPU = {
    "_convolution.deprecated",
    "addbmm",
    "addmm",
    "baddbmm",
    "bmm",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "linalg_vecdot",
    "linear",
    "matmul",
    "mm",
    "prelu",
    "scaled_dot_product_attention",
    "binary_cross_entropy_with_logits",
    "cdist",
    "cosine_embedding_loss",
    "hinge_embedding_loss",
    "huber_loss",
    "kl_div",
    "l1_loss",
    "margin_ranking_loss",
    "mse_loss",
    "multi_margin_loss",
    "multilabel_margin_loss",
    "nll_loss",
    "nll_loss2d",
    "poisson_nll_loss",
    "smooth_l1_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
}

ALLOCATOR_BLOCK = 512  # bytes: the caching allocator's smallest block, and what every block is a multiple of
HALF = (torch.float16, torch.bfloat16)
FLASH_HEAD_DIM = 256  # the widest head flash attention takes (sdp_utils.cpp, check_head_dim_size_flash)


def _eligible(value: Any) -> bool:
    """What autocast casts: a floating-point tensor other than float64 (autocast_mode.h, ``is_eligible``)."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast_to(dtype: torch.dtype) -> Callable[[Any], Any]:
    return lambda value: value.to(dtype) if _eligible(value) else value


def _without_autocast() -> Any:
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def _exists(name: str) -> bool:
    packet, _, overload = name.partition(".")
    return hasattr(torch.ops.aten, packet) and (overload or "default") in getattr(torch.ops.aten, packet).overloads()


def _op(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _policy_kernel(name: str, policy: str) -> Callable[..., Any]:
    """A kernel for the CPU's autocast key that does what CUDA's autocast does for ``name``: casts its arguments
    (``lower``: to the autocast dtype; ``fp32``; ``promote``: to the widest among them), or sets its optional
    dtype to float32 (``fp32_set_opt_dtype``, ``fp32_append_dtype``) where its first argument is eligible; then
    runs it below autocast."""
    op = _op(name)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with _without_autocast():
            if policy == "lower":
                args, kwargs = tree_map(_cast_to(torch.get_autocast_dtype("cpu")), (args, kwargs))
            elif policy == "fp32":
                args, kwargs = tree_map(_cast_to(torch.float32), (args, kwargs))
            elif policy == "promote":
                floating = [value.dtype for value in tree_leaves((args, kwargs)) if _eligible(value)]
                widest = max(floating, key=lambda dtype: torch.finfo(dtype).bits, default=None)
                if widest is not None:
                    args, kwargs = tree_map(_cast_to(widest), (args, kwargs))
            elif _eligible(args[0]):
                return _with_float32_dtype(name, op, args, kwargs, policy == "fp32_append_dtype")
            return op(*args, **kwargs)

    return kernel


def _with_float32_dtype(name: str, op: Any, args: tuple, kwargs: dict, append: bool) -> Any:
    if append:  # the overload with a dtype takes every argument, then the dtype (the dispatcher drops defaults)
        positional = [argument for argument in op._schema.arguments if not argument.kwarg_only]
        args = (*args, *(argument.default_value for argument in positional[len(args) :]))
        return _op(FP32_APPEND_DTYPE[name])(*args, **kwargs, dtype=torch.float32)
    position = next(i for i, argument in enumerate(op._schema.arguments) if argument.name == "dtype")
    if position < len(args):
        args = (*args[:position], args[position] or torch.float32, *args[position + 1 :])
    else:
        kwargs = {**kwargs, "dtype": kwargs.get("dtype") or torch.float32}
    return op(*args, **kwargs)


def _cuda_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` through the kernel CUDA picks on a Hopper or Ampere GPU
    (sdp_utils.cpp, ``select_sdp_backend``, flash first), for 4-D inputs of one dtype and one head width: flash
    attention for half-precision inputs without a mask, heads up to 256 wide (it takes grouped-query heads as they
    are); the memory-efficient kernel for the rest with as many key as query heads (a boolean mask made the additive
    bias it takes); the math kernel otherwise (it keeps the score matrix)."""
    aten = torch.ops.aten
    width = query.shape[-1]
    fused = (
        query.dim() == key.dim() == value.dim() == 4
        and query.dtype == key.dtype == value.dtype
        and width == key.shape[-1] == value.shape[-1]
    )
    same_heads = key.shape[-3] == query.shape[-3]
    if fused and query.dtype in HALF and attn_mask is None and width <= FLASH_HEAD_DIM and (same_heads or enable_gqa):
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if fused and same_heads:
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, attn_mask, True, dropout_p, is_causal, scale=scale
        )[0]
    return aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )[0]


def _rms_normalized(x: torch.Tensor, normalized_shape: list[int], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` over its root mean square in float32 (float64 kept), and the reciprocal of that root."""
    upcast = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    rstd = torch.rsqrt(upcast.pow(2).mean(dims, keepdim=True) + eps)
    return upcast * rstd, rstd


class _FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm (``aten._fused_rms_norm``, which ``rms_norm`` runs on CUDA when the weight's dtype is
    the input's): it saves the input, each row's reciprocal root mean square and the weight, where the CPU's
    composite keeps the normalised input too, a float32 copy of the activations a norm. Its forward computes as
    torch's decomposition of the fused op (torch/_decomp/decompositions.py); its backward is the fused backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor:
        normalized, rstd = _rms_normalized(x, normalized_shape, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.normalized_shape = normalized_shape
        return (normalized if weight is None else normalized * weight).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        x, rstd, weight = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[2]]
        grad_x, grad_weight = torch.ops.aten._fused_rms_norm_backward(grad, x, ctx.normalized_shape, rstd, weight, mask)
        return grad_x, None, grad_weight, None


def _cuda_rms_norm(
    x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None, eps: float | None = None
) -> torch.Tensor:
    """``rms_norm`` as on CUDA (layer_norm.cpp, ``rms_norm_symint``): fused where the weight's dtype is the
    input's, else torch's composite of ops, each saving its own inputs (also where this torch has no fused kernel:
    the op is recent)."""
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    if (weight is not None and weight.dtype != x.dtype) or not _exists("_fused_rms_norm_backward"):
        normalized, _ = _rms_normalized(x, normalized_shape, eps)
        return (normalized if weight is None else normalized * weight).to(x.dtype)
    return _FusedRMSNorm.apply(x, normalized_shape, weight, eps)


def _cuda_dropout(x: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``dropout`` as on CUDA (Dropout.cpp, ``is_fused_kernel_acceptable``): one kernel, ``native_dropout``, which
    writes the output and a byte-an-element mask (saved for backward), where the CPU's composite draws a noise
    tensor in the input's dtype, scales it and multiplies, each op a pass and the noise saved."""
    if not train or p == 0 or x.numel() == 0:
        return x
    if p == 1:
        return x * 0
    return torch.ops.aten.native_dropout(x, p, train)[0]


def _allocator_rounded(self: Any) -> int:
    """``_WeakRefInfo._calculate_mem_consumed`` as torch's tracker computes it for a CUDA tensor."""
    return math.ceil(self.size * self.element_size / ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK


@contextmanager
def cuda_kernels() -> Iterator[None]:
    """While active, this process's CPU ops behave as CUDA's would where that changes what a step holds: CUDA's
    autocast policy, CUDA's attention kernels, the caching allocator's rounding in torch's memory trackers. Only
    for a simulation on fake tensors: the registrations are this process's, undone on exit."""
    library = torch.library.Library("aten", "IMPL")
    policies = {
        **dict.fromkeys(LOWER_PRECISION, "lower"),
        **dict.fromkeys(FP32, "fp32"),
        **dict.fromkeys(FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
        **dict.fromkeys(PROMOTE, "promote"),
        **dict.fromkeys(FP32_APPEND_DTYPE, "fp32_append_dtype"),
    }
    cuda = set(policies) | CUDA_ONLY
    rounding = mem_tracker._WeakRefInfo._calculate_mem_consumed
    try:
        with _overrides_quiet():
            for name, policy in policies.items():
                if name not in SAME_ON_CPU and _exists(name):  # (an op of the header another torch may lack)
                    library.impl(name, _policy_kernel(name, policy), "AutocastCPU")
            for registered in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"):
                name = registered.removeprefix("aten::")
                if registered.startswith("aten::") and name not in cuda:  # the CPU's alone (cross_entropy_loss...)
                    library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
            library.impl("scaled_dot_product_attention", _cuda_attention, "CompositeImplicitAutograd")
            library.impl("rms_norm", _cuda_rms_norm, "CompositeImplicitAutograd")
            library.impl("dropout", _cuda_dropout, "CompositeImplicitAutograd")
        mem_tracker._WeakRefInfo._calculate_mem_consumed = _allocator_rounded  # type: ignore[method-assign]
        yield
    finally:
        mem_tracker._WeakRefInfo._calculate_mem_consumed = rounding  # type: ignore[method-assign]
        library._destroy()


@contextmanager
def _overrides_quiet() -> Iterator[None]:
    """torch warns, once, that a kernel registered here replaces one it has: that is the point."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Warning only once for all operators", UserWarning)
        yield
