"""The memory plan's stand-in for CUDA (project/plan/cuda_kernels.py): its autocast tables against torch's own, and
what a step saves for backward under it against tensors counted by hand."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_memory_plan import resolved
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from project.plan import cuda_kernels
from project.plan.cuda_kernels import cuda_kernels as cuda
from project.plan.memory_plan import simulate_devices

pytestmark = pytest.mark.torch_internals

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


def header_list(macro: str) -> set[str]:
    """The ops of one ``AT_FORALL_*`` list of torch's autocast header, as ``name`` or ``name.overload``."""
    body = re.search(rf"#define {macro}\(_\)(.*?)(?:\n\s*\n|#define)", HEADER.read_text(), re.S)
    assert body is not None, macro
    return {
        f"{name}.{overload}" if overload else name
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body.group(1))
    }


@pytest.mark.skipif(not HEADER.exists(), reason="this torch ships no C++ headers")
@pytest.mark.parametrize(
    "macro, table",
    [
        ("AT_FORALL_LOWER_PRECISION_FP", cuda_kernels.LOWER_PRECISION),
        ("AT_FORALL_FP32", cuda_kernels.FP32),
        ("AT_FORALL_FP32_SET_OPT_DTYPE", cuda_kernels.FP32_SET_OPT_DTYPE),
        ("AT_FORALL_PROMOTE", cuda_kernels.PROMOTE),
    ],
)
def test_each_policy_lists_what_torchs_header_lists(macro, table):
    assert set(table) == header_list(macro)


def test_the_tables_cover_every_op_torch_registers_for_cuda_autocast():
    registered = {
        name.removeprefix("aten::") for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    }
    tables = [cuda_kernels.LOWER_PRECISION, cuda_kernels.FP32, cuda_kernels.FP32_SET_OPT_DTYPE, cuda_kernels.PROMOTE]
    listed = {name for table in tables for name in table} | set(cuda_kernels.FP32_APPEND_DTYPE)
    assert listed | cuda_kernels.CUDA_ONLY == registered
    # What the CPU keeps as its own must be registered for the CPU's autocast.
    cpu = {name.removeprefix("aten::") for name in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")}
    assert cpu >= cuda_kernels.SAME_ON_CPU


def saved_for_backward(run) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The tensors autograd saves while ``run()`` runs, as (shape, dtype), each storage once (two ops may save
    one tensor), on fake CPU tensors."""
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage()._cdata] = (tuple(tensor.shape), tensor.dtype)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return list(saved.values())


TOKENS, VOCAB = 6, 10


def cross_entropy_saves() -> list:
    with FakeTensorMode():
        logits = torch.empty(TOKENS, VOCAB, dtype=torch.bfloat16, requires_grad=True)
        target = torch.zeros(TOKENS, dtype=torch.long)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return saved_for_backward(lambda: F.cross_entropy(logits, target))


def test_cross_entropy_saves_cudas_bf16_log_softmax_and_nll_losss_float32_copy():
    cpu_saved = cross_entropy_saves()
    with cuda():
        cuda_saved = cross_entropy_saves()
    logits = (TOKENS, VOCAB)
    # The CPU casts cross_entropy whole: its log_softmax runs and is saved in float32.
    assert [dtype for shape, dtype in cpu_saved if shape == logits] == [torch.float32]
    # CUDA casts only nll_loss: log_softmax saves its bf16 output, nll_loss its float32 input.
    assert [dtype for shape, dtype in cuda_saved if shape == logits] == [torch.bfloat16, torch.float32]
    # Undone on exit: the CPU's policy again.
    assert cross_entropy_saves() == cpu_saved


def test_norms_and_softmax_run_in_float32_as_under_cudas_autocast():
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=torch.bfloat16)
        weight = torch.empty(8)
        ops = {
            "layer_norm": lambda: F.layer_norm(x, (8,), weight),
            "rms_norm": lambda: F.rms_norm(x, (8,), weight),
            "softmax": lambda: F.softmax(x, -1),
            "sum": lambda: x.sum(),
            "exp": lambda: x.exp(),
        }
        with torch.autocast("cpu", dtype=torch.bfloat16):
            on_cpu = {name: op().dtype for name, op in ops.items()}
            with cuda():
                on_cuda = {name: op().dtype for name, op in ops.items()}
                kept = F.softmax(x, -1, dtype=torch.bfloat16).dtype  # an explicit dtype stays
                # promote: to the widest input (scatter_add itself refuses mixed dtypes)
                promoted = x.scatter_add(0, torch.zeros(4, 8, dtype=torch.long), torch.empty(4, 8)).dtype
                norm = torch.ops.aten.norm.Scalar(x, 2).dtype  # fp32_append_dtype: its overload with a dtype
    # rms_norm: float32 where the installed torch's CUDA autocast lists it (2.13; 2.11 runs it in bfloat16)
    expected = {name: torch.float32 if name in cuda_kernels.FP32 or name != "rms_norm" else x.dtype for name in ops}
    assert on_cuda == expected
    assert on_cpu["layer_norm"] == on_cpu["softmax"] == torch.bfloat16  # the CPU's policy differs for these
    assert kept == torch.bfloat16
    assert promoted == norm == torch.float32


BATCH, HEADS, KV_HEADS, SEQ, WIDTH = 2, 4, 2, 16, 8


def attention_saves(dropout: float) -> list:
    with FakeTensorMode():
        q = torch.empty(BATCH, HEADS, SEQ, WIDTH, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.empty(BATCH, KV_HEADS, SEQ, WIDTH, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        return saved_for_backward(
            lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=True)
        )


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_attention_saves_flash_attentions_inputs_output_and_log_sum_exp(dropout):
    with cuda():
        saved = attention_saves(dropout)
    query, kv = (BATCH, HEADS, SEQ, WIDTH), (BATCH, KV_HEADS, SEQ, WIDTH)
    tensors = sorted(((shape, dtype) for shape, dtype in saved if len(shape) >= 3), key=str)
    # Flash attention's backward (derivatives.yaml): query, key, value (grouped-query heads as they are), output,
    # and the log-sum-exp of each query's scores in float32; besides, its random state (two uint64 scalars).
    assert tensors == sorted(
        [(query, torch.bfloat16), (kv, torch.bfloat16), (kv, torch.bfloat16), (query, torch.bfloat16)]
        + [((BATCH, HEADS, SEQ), torch.float32)],
        key=str,
    )
    assert sum(1 for shape, _ in saved if len(shape) < 3) == 2


def test_under_dropout_the_cpus_kernel_keeps_the_score_matrix_cudas_does_not():
    scores = (BATCH, HEADS, SEQ, SEQ)
    assert any(shape == scores for shape, _ in attention_saves(0.1))  # the CPU's math fallback
    with cuda():
        assert not any(shape[-2:] == (SEQ, SEQ) for shape, _ in attention_saves(0.1))


@pytest.mark.parametrize("nbytes, counted", [(1, 512), (512, 512), (513, 1024), (3 * 2**20 + 1, 3 * 2**20 + 512)])
def test_the_tracker_counts_each_tensor_in_the_allocators_512_byte_blocks(nbytes, counted):
    def held() -> int:
        with FakeTensorMode(), MemTracker() as tracker:
            tensor = torch.empty(nbytes, dtype=torch.uint8)
            total = sum(sizes["Total"] for sizes in tracker.get_tracker_snapshot().values())
            del tensor
        return total

    assert held() == nbytes  # the CPU's tensors, as torch counts them
    with cuda():
        assert held() == counted


@pytest.mark.parametrize("model, rms_norms_a_block", [("gpt", 0), ("llama", 2)])
def test_a_plan_for_gpus_saves_what_the_kernels_above_add_up_to(model, rms_norms_a_block):
    """The tiny model's bf16-mixed plan, for this CPU and for a cluster of H100s. The GPU's plan saves, beside the
    CPU's: the loss's bf16 log_softmax (both save a float32 copy of the logits: the CPU's log_softmax output,
    CUDA's input to nll_loss), and each attention kernel's random state (flash attention's two uint64 tensors, of
    2 and 1 elements). It saves less for each RMSNorm (Llama's two a block and its last): CUDA's fused kernel
    keeps its input and the rows' reciprocal roots, the CPU's composite also the normalised input in float32.
    Nothing else differs."""
    overrides = [f"model={model}", "data=tokens", "trainer.precision=bf16-mixed", "logger=none"]
    on_cpu, on_gpus = resolved(overrides), resolved([*overrides, "cluster=h100_sxm_8x"])
    assert not on_cpu.on_gpus and on_gpus.on_gpus
    cpu, gpu = (simulate_devices(job)[0][0] for job in (on_cpu, on_gpus))
    net = on_cpu.model.net.keywords
    tokens, layers = on_cpu.batch_size * on_cpu.seq_length, on_cpu.model.num_layers
    rms_norms = rms_norms_a_block * layers + (rms_norms_a_block > 0)
    added = tokens * net["vocab_size"] * 2 + layers * 3 * 8
    assert gpu.activations - cpu.activations == added - rms_norms * tokens * net["dim"] * 4
    assert gpu.flops == cpu.flops  # the same arithmetic, on other kernels


def test_the_fused_rms_norm_computes_what_rms_norm_does():
    """On real tensors, against the CPU's own rms_norm and its autograd. The fused backward has no CPU kernel in
    torch (the plan runs it on fake tensors, through its meta kernel); torch's decomposition of it stands in."""
    backward = torch.ops.aten._fused_rms_norm_backward.default
    library = torch.library.Library("aten", "IMPL")
    library.impl("_fused_rms_norm_backward", torch._decomp.decomposition_table[backward], "CPU")
    try:
        x, weight = torch.randn(3, 5, 8, requires_grad=True), torch.randn(8, requires_grad=True)
        expected = F.rms_norm(x, (8,), weight, 1e-5)
        grad = torch.randn_like(expected)
        with cuda():
            fused = F.rms_norm(x, (8,), weight, 1e-5)
            fused_grads = torch.autograd.grad(fused, (x, weight), grad)
    finally:
        library._destroy()
    torch.testing.assert_close(fused, expected)
    for got, want in zip(fused_grads, torch.autograd.grad(expected, (x, weight), grad), strict=True):
        torch.testing.assert_close(got, want)


def test_every_override_is_undone_on_exit_even_after_an_error():
    """After the context, even one left by an exception: the CPU's attention (its score matrix under dropout), its
    autocast, its tracker's exact bytes again."""
    cpu_saved = cross_entropy_saves()
    with pytest.raises(RuntimeError, match="inside"), cuda():
        raise RuntimeError("inside")
    assert any(shape == (BATCH, HEADS, SEQ, SEQ) for shape, _ in attention_saves(0.1))
    assert cross_entropy_saves() == cpu_saved
    with FakeTensorMode(), MemTracker() as tracker:
        tensor = torch.empty(1, dtype=torch.uint8)
        assert sum(sizes["Total"] for sizes in tracker.get_tracker_snapshot().values()) == 1
        del tensor


def test_an_rms_norm_whose_weight_has_another_dtype_keeps_the_inputs():
    """CUDA fuses only where the weight's dtype is the input's; else its composite returns the input's dtype."""
    with FakeTensorMode(), cuda():
        x = torch.empty(4, 8, dtype=torch.bfloat16)
        assert F.rms_norm(x, (8,), torch.empty(8), 1e-5).dtype == torch.bfloat16


def dropout_saves() -> list:
    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=torch.bfloat16, requires_grad=True)
        return saved_for_backward(lambda: F.dropout(x, 0.1, training=True))


def test_dropout_saves_cudas_byte_mask_not_the_cpus_noise():
    """CUDA's dropout is one kernel (``native_dropout``) that saves a mask of a byte an element; the CPU's composite
    saves a noise tensor in the input's dtype. Undone on exit."""
    cpu_saved = dropout_saves()
    with cuda():
        assert dropout_saves() == [((4, 8), torch.bool)]
    assert cpu_saved == [((4, 8), torch.bfloat16)]
    assert dropout_saves() == cpu_saved


def test_cudas_dropout_keeps_or_scales_each_element_as_dropout_does():
    """On real tensors: each element zero or scaled by 1 / (1 - p), about p of them dropped; outside training, and
    at p = 0, the input itself."""
    torch.manual_seed(0)
    x = torch.rand(200, 50) + 1
    with cuda():
        dropped = F.dropout(x, 0.25, training=True)
        assert F.dropout(x, 0.25, training=False) is x and F.dropout(x, 0.0, training=True) is x
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], x[kept] / 0.75)
    assert abs((~kept).float().mean().item() - 0.25) < 0.02
