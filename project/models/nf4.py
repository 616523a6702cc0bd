"""QLoRA's frozen base (Dettmers et al., 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"): the Linear weights
of the blocks stored in 4-bit NormalFloat (NF4), torchao's ``NF4Tensor``, with LoRA's adapters trained on top.

Each run of 64 weights (a block, in row-major order) keeps 4-bit indices into the 16 NF4 levels and its absolute
maximum; those maxima are quantized again to 8 bits, in runs of 256 blocks, around their mean (double quantization):
about 4.13 bits a weight. ``F.linear`` on an ``NF4Tensor`` dequantizes it to the input's dtype for that layer's
matmul alone (and again in backward, for the input's gradient: the weight takes none). The embedding, the norms,
the biases and the output layer stay as they are, as in the paper.

torchao is an optional dependency (``pip install 'project[qlora]'``); nothing here imports it until a run asks for
``model.lora.quantize_base``.
"""

import sys
from types import ModuleType
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from project.models.sequence import BlockSequence
from project.models.torchao_import import import_torchao
from project.options.errors import ConfigError

BLOCK = 64  # weights per quantization block (the paper's, torchao's default)
SCALER_BLOCK = 256  # blocks per block of their double-quantized maxima
WEIGHTS_PER_SCALER_BLOCK = BLOCK * SCALER_BLOCK  # the quantum a quantized weight's size, and a shard's, is made of
NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def torchao_nf4() -> ModuleType:
    """torchao's NF4 module (``import_torchao``)."""
    return import_torchao(
        NF4_MODULE,
        "model.lora.quantize_base",
        "pip install 'project[qlora]' (torchao, the optional extra), or set model.lora.quantize_base=false.",
    )


def quantizable_weights(net: BlockSequence) -> dict[str, nn.Linear]:
    """The layers whose weights QLoRA stores in NF4: every frozen Linear of the blocks (not LoRA's adapters), by
    name under ``net``."""
    return {
        f"blocks.{index}.{name}": module
        for index, block in enumerate(net.blocks)
        for name, module in block.named_modules()
        if isinstance(module, nn.Linear) and not module.weight.requires_grad
    }


def quantize_base(net: BlockSequence) -> None:
    """Store the frozen Linear weights of ``net``'s blocks in NF4 (in place; on the meta device, before a strategy
    shards them, so that FSDP shards and gathers the 4-bit data). ``ConfigError`` for a weight whose size is not a
    multiple of a block of maxima (64 x 256 weights), which NF4 cannot store."""
    nf4 = torchao_nf4()
    if any(parameter.dim() > 2 for parameter in net.blocks.parameters()):
        raise ConfigError(
            "model.lora.quantize_base",
            f"stores the blocks' Linear weights in NF4, but most of {type(net).__name__}'s are its experts' stacked "
            "tensors, which it does not quantize.",
            "set model.lora.quantize_base=false: LoRA over the full-precision mixture.",
        )
    for name, layer in quantizable_weights(net).items():
        if layer.weight.numel() % WEIGHTS_PER_SCALER_BLOCK:
            raise ConfigError(
                "model.lora.quantize_base",
                f"stores {name}.weight ({tuple(layer.weight.shape)}) in NF4, whose size must be a multiple of "
                f"{WEIGHTS_PER_SCALER_BLOCK} weights ({BLOCK}-weight blocks, their maxima quantized {SCALER_BLOCK} "
                "at a time).",
                "give the model dimensions whose products are multiples of 16384 (the released models' presets' "
                "are), or set model.lora.quantize_base=false.",
            )
        weight = empty_nf4(layer.weight) if layer.weight.is_meta else nf4.to_nf4(layer.weight, BLOCK, SCALER_BLOCK)
        layer.weight = nn.Parameter(weight, requires_grad=False)


def empty_nf4(weight: torch.Tensor) -> torch.Tensor:
    """An NF4 tensor of ``weight``'s shape and dtype on the meta device, its parts as ``to_nf4`` makes them. Made
    directly: ``to_nf4`` runs the quantization on the meta device, in chunks of a million weights (seconds for a
    405B model's blocks, which the checks and the memory plan build several times)."""
    nf4, count = torchao_nf4(), weight.numel()
    return nf4.NF4Tensor(
        nf4.SubclassTensorArgs(weight.shape, weight.stride(), 0, weight.dtype, weight.device, False),
        BLOCK,
        count // BLOCK,
        SCALER_BLOCK,
        torch.empty(count // BLOCK, dtype=torch.int8, device="meta"),  # the blocks' maxima, quantized
        torch.empty(count // WEIGHTS_PER_SCALER_BLOCK, dtype=weight.dtype, device="meta"),  # their factors
        torch.empty((), dtype=weight.dtype, device="meta"),  # the maxima's mean
        torch.empty(count // 2, dtype=torch.uint8, device="meta"),  # two 4-bit indices a byte
        torch.empty(16, dtype=weight.dtype, device="meta"),  # the levels
    )


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (a parameter; sharded, its local piece) is stored in NF4."""
    nf4 = sys.modules.get(NF4_MODULE)  # imported by quantize_base: a run that quantizes nothing does not import it
    return nf4 is not None and isinstance(_local(tensor), nf4.NF4Tensor)


def _local(parameter: torch.Tensor) -> Any:
    """The tensor object holding this rank's part of ``parameter``: a sharded one's own local tensor, the one FSDP
    gathers from (``to_local()`` returns a view, a new NF4Tensor, whose parts set here would not reach it)."""
    return parameter._local_tensor if isinstance(parameter, DTensor) else parameter


def splits_evenly(weight: torch.Tensor, shards: int) -> bool:
    """Whether NF4 ``weight`` splits into ``shards`` row ranges, each a whole number of blocks of maxima: what
    FSDP's sharding of it needs (a weight that does not stays whole on every rank: ``apply_fsdp``)."""
    return weight.shape[0] % shards == 0 and (weight.numel() // shards) % WEIGHTS_PER_SCALER_BLOCK == 0


# torchao's NF4Tensor holds its 4-bit data, block maxima and their factors (sharded by FSDP), their mean and the
# 16 levels (whole on every rank, not moved by ``to_empty``: they stay on the meta device until set here).
_UNSHARDED = ("scaler_mean", "nf4")


def allocate_nf4(parameter: torch.Tensor, device: torch.device) -> None:
    """Give the parts of an NF4 ``parameter`` that ``to_empty`` leaves on the meta device storage on ``device``."""
    local = _local(parameter)
    for name in _UNSHARDED:
        part = getattr(local, name)
        if part.is_meta:
            setattr(local, name, torch.empty_like(part, device=device))


@torch.no_grad()
def fill_nf4(parameter: torch.Tensor, value: torch.Tensor) -> None:
    """Set NF4 ``parameter`` (a Parameter, or FSDP's DTensor of row shards) to ``value`` (the whole weight, in full
    precision) quantized: the whole weight is quantized, then this rank keeps its rows, so the stored values do not
    depend on the sharding (the block maxima's mean is the whole weight's)."""
    nf4, local = torchao_nf4(), _local(parameter)
    quantized = nf4.to_nf4(value.to(local.device, local.dtype), BLOCK, SCALER_BLOCK)
    if isinstance(parameter, DTensor):
        # FSDP2's sharding on one mesh dimension: dim-0 chunks, rank i the i-th (torchao's split keeps the blocks).
        (mesh_dim,) = range(parameter.device_mesh.ndim)
        chunks = torch.chunk(quantized, parameter.device_mesh.size(mesh_dim), dim=0)
        quantized = chunks[parameter.device_mesh.get_local_rank(mesh_dim)]
    for name in quantized.__tensor_flatten__()[0]:
        setattr(local, name, getattr(quantized, name).clone())


def dequantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each NF4 tensor replaced by its dequantized value (what the run computed with)."""
    return {name: cast(Any, value).get_original_weight() if is_nf4(value) else value for name, value in state.items()}
