"""Model FLOPs of a training step and the GPUs' peaks: what ``perf/tflops_per_device`` and ``perf/mfu`` are made of."""

import copy

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

# Dense peak TFLOPS (no structured sparsity) of NVIDIA's datacenter GPUs, from NVIDIA's datasheets, for the dtype
# the tensor cores compute in: bf16 (also fp16: the same rate on these parts), tf32 (fp32 matmuls with TF32 on)
# and fp32 (TF32 off). The datasheets list the sparse rate for bf16 and tf32; the dense rate is half of it.
# Matched in order against torch.cuda.get_device_name(), so the more specific names come first. None: no peak to
# divide by; such GPUs, and those not listed, log perf/tflops_per_device without perf/mfu.
PEAK_TFLOPS: list[tuple[str, dict[str, float] | None]] = [
    ("A10G", None),  # AWS's variant of the A10: no NVIDIA datasheet of its own, so no peak rather than a guess
    ("H200 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),  # H200 datasheet (NVL form factor)
    ("H200", {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0}),  # H200 datasheet (SXM)
    ("H100 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),  # H100 datasheet, NVL
    ("H100 PCIe", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.0}),  # H100 datasheet, PCIe
    ("H100", {"bf16": 989.5, "tf32": 494.5, "fp32": 67.0}),  # H100 datasheet, SXM ("NVIDIA H100 80GB HBM3")
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),  # A100 datasheet, SXM and PCIe alike
    ("L40S", {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6}),  # L40S datasheet
    ("L4", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),  # L4 datasheet
    ("A10", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),  # A10 datasheet
]


def peak_tflops(device_name: str, precision: str, tf32: bool) -> float | None:
    """The dense peak of the GPU called ``device_name`` for a run at Lightning ``precision`` (None: unknown)."""
    dtype = "bf16" if precision.startswith(("bf16", "16")) else "tf32" if tf32 else "fp32"
    peaks = next((peaks for name, peaks in PEAK_TFLOPS if name in device_name), None)
    return None if peaks is None else peaks[dtype]


def training_flops_per_sample(net: nn.Module, inputs: torch.Tensor) -> int:
    """FLOPs of one sample's forward and backward pass through ``net``, counted by torch's ``FlopCounterMode``:
    the matrix multiplications and attention (2 per multiply-add), on a copy of ``net``, which is on the meta
    device: nothing is computed or allocated. ``inputs`` is a batch (only its shape and dtype are used).

    These are model FLOPs, the MFU convention: a recomputation (activation checkpointing) does not count. For a
    transformer the count is nanoGPT's and PaLM's 6N + 12·L·H·Q·T per token (N the matmul weights, L layers, H
    heads of width Q, T tokens of context), which tests/test_flops.py checks.
    """
    if not all(parameter.is_meta for parameter in net.parameters()):
        raise ValueError("training_flops_per_sample counts on a model on the meta device")
    meta_net = copy.deepcopy(net)  # the backward pass would give the caller's model (meta) gradients
    sample = torch.empty((1, *inputs.shape[1:]), dtype=inputs.dtype, device="meta")
    with FlopCounterMode(display=False) as counter:
        meta_net(sample).sum().backward()
    return counter.get_total_flops()
