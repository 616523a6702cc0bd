"""Tensor-parallel plans of this project's models, torchtitan style: for each model a plain function that lays its
layers out over a tensor-parallel mesh with torch's parallel styles (torchao's float8 ones for Float8 layers on GPUs),
and the sizes that layout needs.

Megatron's layout: in a transformer block the query, key and value projections and the MLP's first layers are split
by output features (``ColwiseParallel``: each rank computes its own heads and its own slice of the hidden layer),
the attention's output projection and the MLP's last layer by input features (``RowwiseParallel``: partial sums,
added up across the ranks), so a block costs two collectives forward and two backward. With sequence parallelism
the norms and the residual stream between blocks hold only each rank's share of the sequence
(``SequenceParallel``): each all-reduce becomes a reduce-scatter and an all-gather (the same traffic), and the
activations outside attention and MLP take 1/T of the memory. The token embedding is split by vocabulary, and so is
the output layer: with loss parallelism the logits stay split into the loss, and no rank holds the logits of the
whole vocabulary.

Every parameter ends up a DTensor on the mesh, split or replicated (norms, GPT's position table, the biases added
after a row-wise split), so that FSDP shards them all alike over the data-parallel dimension and gradient clipping
sees one kind of tensor. A plan acts on whichever of ``stem``, ``blocks`` and ``head`` a rank still holds (a
pipeline stage drops the others), block by block in the model's own numbering.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from project.models import gpt, llama
from project.models.float8 import torchao_float8, uses_float8_tensor_parallel_styles
from project.models.gpt import GPT, LMHead
from project.models.llama import Llama
from project.models.mlp import MLP
from project.parallel.local_tensors import local_tensor


class ReplicateParallel(ParallelStyle):
    """The module computed whole on every rank: its parameters become replicated DTensors, plain tensors come in
    and go out. torch has no such style; torchtitan's ``NoParallel`` is the same idea."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torch types input_fn and output_fn as returning None, but uses what they return as the module's inputs
        # and output.
        return distribute_module(
            module,
            device_mesh,
            _replicate_parameters,
            _inputs_replicated,  # type: ignore[arg-type]
            _output_local,  # type: ignore[arg-type]
        )


def _replicate_parameters(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for parameter_name, parameter in list(module.named_parameters(recurse=False)):
        module.register_parameter(
            parameter_name, nn.Parameter(DTensor.from_local(parameter, mesh, [Replicate()], run_check=False))
        )


def _inputs_replicated(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _output_local(module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return local_tensor(output)


def _norm(sequence_parallel: bool) -> ParallelStyle:
    """A norm's style: on its share of the sequence, or whole on every rank."""
    return SequenceParallel() if sequence_parallel else ReplicateParallel()


def _gradient_split_like_weight(embedding: nn.Embedding) -> None:
    """torch computes a vocabulary-split embedding's gradient whole on every rank when its lookups are all-reduced
    (the GPT's, whose position table is added after): each rank keeps only its own rows of it, as of the table,
    instead of a whole table's gradient. The hook goes on the weight the forward uses: materialising (and FSDP's
    gathering) replaces the parameter, and a parameter's hooks go with it."""

    def keep_own_rows(weight: nn.Parameter) -> None:
        # A vocabulary-split weight: a DTensor, as is its gradient.
        weight.grad = cast(DTensor, weight.grad).redistribute(placements=cast(DTensor, weight).placements)

    def hook_weight(module: nn.Module, args: tuple) -> None:
        weight = cast(nn.Parameter, module.weight)  # the embedding's table
        if weight.requires_grad and not getattr(weight, "keeps_own_rows", False):  # frozen (LoRA): no gradient
            weight.register_post_accumulate_grad_hook(keep_own_rows)
            weight.keeps_own_rows = True  # type: ignore[attr-defined]  # a mark of our own on the parameter

    embedding.register_forward_pre_hook(hook_weight)


def _distribute_parameters(
    module: nn.Module, mesh: DeviceMesh, weight: Placement, bias: Placement, source: int | None
) -> None:
    """``module``'s own weight and bias (not its children's) as DTensors of these placements, as trainable as before."""
    for name, parameter in list(module.named_parameters(recurse=False)):
        distributed = distribute_tensor(parameter, mesh, [weight if name == "weight" else bias], src_data_rank=source)
        module.register_parameter(name, nn.Parameter(distributed, requires_grad=parameter.requires_grad))


class AdaptedColwiseParallel(ColwiseParallel):
    """torch's ``ColwiseParallel``, which also lays out a ``LoRALinear``: its base split by output features as a
    Linear's, its ``lora_a`` whole on every rank (each needs the whole low-rank input), its ``lora_b`` split by output
    features like the base, so each rank adds the update of its own outputs with no collective. (torch's style
    registers every parameter of the module under its own name, which a child's ``lora_a.weight`` cannot be.)"""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        placement = Replicate() if name == "lora_a" else Shard(0)
        _distribute_parameters(module, device_mesh, placement, placement, self.src_data_rank)


class AdaptedRowwiseParallel(RowwiseParallel):
    """torch's ``RowwiseParallel``, which also lays out a ``LoRALinear``: its base split by input features as a
    Linear's (its bias whole), its ``lora_a`` split by input features like the base, its ``lora_b`` whole: each rank's
    update is a partial sum, added up with the base's in the style's one collective."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        weight = Replicate() if name == "lora_b" else Shard(1)
        _distribute_parameters(module, device_mesh, weight, Replicate(), self.src_data_rank)


def _colwise(layer: nn.Module) -> ParallelStyle:
    """A layer split by output features: torchao's float8 style where ``uses_float8_tensor_parallel_styles`` says
    so (its input cast to float8 first), else torch's (as ``AdaptedColwiseParallel``, which lays out LoRA's too)."""
    if uses_float8_tensor_parallel_styles(layer):
        return torchao_float8(".float8_tensor_parallel").Float8ColwiseParallel()
    return AdaptedColwiseParallel()


def _rowwise(
    layer: nn.Module, input_layouts: Placement | None = None, output_layouts: Placement | None = None
) -> ParallelStyle:
    """A layer split by input features, its partial sums added up into ``output_layouts``; in float8 as
    ``_colwise``."""
    if uses_float8_tensor_parallel_styles(layer):
        return torchao_float8(".float8_tensor_parallel").Float8RowwiseParallel(
            input_layouts=input_layouts, output_layouts=output_layouts
        )
    return AdaptedRowwiseParallel(input_layouts=input_layouts, output_layouts=output_layouts)


def _gathered(layers: list[nn.Module]) -> ParallelStyle:
    """The whole sequence into attention or the MLP, all-gathered from the ranks' shares: cast to float8 before the
    gather (a byte an element, one cast for all) where every layer it feeds computes in float8 so, else as it is."""
    layouts: dict[str, Any] = {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
    if all(uses_float8_tensor_parallel_styles(layer) for layer in layers):
        return torchao_float8(".float8_tensor_parallel").PrepareFloat8ModuleInput(**layouts)
    return PrepareModuleInput(**layouts)


def _transformer_block_plan(
    block: nn.Module,
    attention: tuple[str, str, str, str],
    mlp_in: tuple[str, ...],
    mlp_out: str,
    sequence_parallel: bool,
) -> dict[str, ParallelStyle]:
    """A pre-norm ``block``, ``x + attention(norm1(x))``, ``x + mlp(norm2(x))``: ``attention`` names the query, key,
    value and output projections; ``mlp_in`` the MLP's first layers, ``mlp_out`` its last."""
    between_blocks = Shard(1) if sequence_parallel else Replicate()  # the residual stream
    plan: dict[str, ParallelStyle] = {"norm1": _norm(sequence_parallel), "norm2": _norm(sequence_parallel)}
    *projections, output = attention
    for part, first, last in (("attention", projections, output), ("mlp", mlp_in, mlp_out)):
        layers = {name: block.get_submodule(f"{part}.{name}") for name in first}
        if sequence_parallel:
            plan[part] = _gathered(list(layers.values()))
        plan.update({f"{part}.{name}": _colwise(layer) for name, layer in layers.items()})
        plan[f"{part}.{last}"] = _rowwise(block.get_submodule(f"{part}.{last}"), output_layouts=between_blocks)
    return plan


def _head_plan(sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The final norm and the output layer, split by vocabulary: its logits gathered, or left split for the loss
    (a DTensor sharded on the vocabulary)."""
    return {
        "norm": _norm(sequence_parallel),
        "output": ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def _parallelize_decoder(
    net: GPT | Llama,
    mesh: DeviceMesh,
    stem_plan: dict[str, ParallelStyle],
    block_plan: Callable[[nn.Module], dict[str, ParallelStyle]],
    sequence_parallel: bool,
    loss_parallel: bool,
) -> None:
    """Apply the plans to the parts this rank holds (``nn.Identity`` marks a dropped one), keeping a tied output
    layer tied to the embedding (both split by vocabulary alike)."""
    holds = {part: not isinstance(getattr(net, part), nn.Identity) for part in ("stem", "head")}
    # Where held, the stem and head are the decoder's own (both models' stems keep the token table as ``tokens``).
    head, stem = cast(LMHead, net.head), cast(gpt.Embedding | llama.TokenEmbedding, net.stem)
    tied = holds["stem"] and holds["head"] and head.output.weight is stem.tokens.weight
    if holds["stem"]:
        parallelize_module(net.stem, mesh, stem_plan)
    for block in net.blocks:
        if not isinstance(block, nn.Identity):
            parallelize_module(block, mesh, block_plan(block))
    if holds["head"]:
        parallelize_module(net.head, mesh, _head_plan(sequence_parallel, loss_parallel))
    if tied:
        head.output.weight = stem.tokens.weight


def parallelize_gpt(net: GPT, mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """The token table split by vocabulary (its lookups all-reduced) plus the replicated position table; under
    sequence parallelism each rank then keeps its share of the sequence."""
    stem_plan: dict[str, ParallelStyle] = {
        "tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "positions": ReplicateParallel(),
    }

    def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
        return _transformer_block_plan(block, ("q", "k", "v", "proj"), ("up",), "down", sequence_parallel)

    _parallelize_decoder(net, mesh, stem_plan, block_plan, sequence_parallel, loss_parallel)
    if not isinstance(net.stem, nn.Identity):
        _gradient_split_like_weight(cast(gpt.Embedding, net.stem).tokens)
        if sequence_parallel:  # the sum of the two, cut to each rank's share
            parallelize_module(
                net.stem, mesh, PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
            )


def parallelize_llama(net: Llama, mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """torchtitan's Llama plan: the token table split by vocabulary, its lookups reduce-scattered straight into
    each rank's share of the sequence under sequence parallelism."""
    stem_plan: dict[str, ParallelStyle] = {
        "tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sequence_parallel else Replicate()
        )
    }

    def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
        plan = _transformer_block_plan(block, ("q", "k", "v", "o"), ("gate", "up"), "down", sequence_parallel)
        if cast(llama.Block, block).attention.q_norm is not None:
            # Qwen 3's per-head norms, on each rank's heads (dim 2 of the (batch, length, heads, width) projections):
            # one weight for every head, its gradient summed over the ranks' heads (torchtitan's Qwen 3 plan too).
            on_own_heads = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan.update({"attention.q_norm": on_own_heads, "attention.k_norm": on_own_heads})
        return plan

    _parallelize_decoder(net, mesh, stem_plan, block_plan, sequence_parallel, loss_parallel)


def parallelize_mlp(net: MLP, mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Blocks in pairs: the first split by output features, the ReLU on each rank's slice, the second by input
    features (its partial sums all-reduced), so a pair costs one collective each way. An unpaired last layer (the
    classifier, a few outputs) stays whole on every rank. No sequence, no vocabulary: the two switches do nothing."""
    pairs = len(net.blocks) // 2
    for index, block in enumerate(net.blocks):
        if isinstance(block, nn.Identity):
            continue
        linear = "0" if isinstance(block, nn.Sequential) else ""
        layer = block.get_submodule(linear)
        if index >= 2 * pairs:
            style: ParallelStyle = ReplicateParallel()
        elif index % 2 == 0:
            style = _colwise(layer)
        else:
            style = _rowwise(layer, input_layouts=Shard(-1))
        parallelize_module(block, mesh, {linear: style} if linear else style)


def _decoder_split_sizes(net: GPT | Llama) -> list[tuple[str, str, int]]:
    block = cast(gpt.Block | llama.Block, net.blocks[0])
    attention = block.attention
    sizes = [("num_heads", "attention heads", attention.q.out_features // attention.head_dim)]
    if isinstance(net, Llama):  # (the GPT's MLP width, 4 x dim, divides whenever its heads do)
        sizes += [
            ("num_kv_heads", "key/value heads", attention.k.out_features // attention.head_dim),
            ("hidden_dim", "SwiGLU hidden units", cast(llama.SwiGLU, cast(llama.Block, block).mlp).up.out_features),
        ]
    return sizes


def _mlp_split_sizes(net: MLP) -> list[tuple[str, str, int]]:
    pairs = len(net.blocks) // 2  # the first layer of each pair, split by its outputs
    return [
        # Each hidden block is Sequential(Linear, ReLU).
        (
            "hidden_dims",
            f"units of hidden layer {index}",
            cast(nn.Linear, cast(nn.Sequential, net.blocks[index])[0]).out_features,
        )
        for index in range(0, 2 * pairs, 2)
    ]


@dataclass(frozen=True)
class ModelPlan:
    """How a model is split over tensor-parallel ranks: the function that lays it out (``(net, mesh,
    sequence_parallel, loss_parallel)``), the counts that layout shares out (``split_sizes(net)``: each as the model
    argument that sets it, what it counts, the count; every one must divide by the tensor-parallel size), and whether
    its activations have a sequence dimension to split (sequence parallelism)."""

    parallelize: Callable[[Any, DeviceMesh, bool, bool], None]
    split_sizes: Callable[[Any], list[tuple[str, str, int]]]
    has_sequence: bool


# Every model's parallel plan: the one table to extend when adding a model (docs/architecture.md).
PLANS: dict[type[nn.Module], ModelPlan] = {
    GPT: ModelPlan(parallelize_gpt, _decoder_split_sizes, has_sequence=True),
    Llama: ModelPlan(parallelize_llama, _decoder_split_sizes, has_sequence=True),
    MLP: ModelPlan(parallelize_mlp, _mlp_split_sizes, has_sequence=False),
}


def model_plan(net: nn.Module) -> ModelPlan | None:
    """``net``'s plan, or None for a model that has none."""
    return PLANS.get(type(net))


def apply_tensor_parallel(
    net: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = True, loss_parallel: bool = True
) -> None:
    """Lay ``net`` (on the meta device) out over the tensor-parallel ``mesh`` with its model's plan. Frozen parameters
    (LoRA's base) stay frozen: torch's replicating styles make every parameter they replace trainable."""
    frozen = {name for name, parameter in net.named_parameters() if not parameter.requires_grad}
    PLANS[type(net)].parallelize(net, mesh, sequence_parallel, loss_parallel)
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name not in frozen)
