"""Parallelism as plain functions on a model's ordered block sequence (``model.blocks``), torchtitan style.

Strategies call these; the models know nothing about them.
"""

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from project.accounting.counts import counting, kept_for_backward, recomputing
from project.checkpointing.hf import HFWeights
from project.models.init import initial_value
from project.models.lora import is_adapter
from project.models.nf4 import allocate_nf4, fill_nf4, is_nf4, splits_evenly
from project.models.sequence import BlockSequence
from project.parallel.expert_parallel import ExpertParallelMLPs


def block_sizes(model: BlockSequence) -> list[int]:
    """Parameters per block: what a balanced stage split balances."""
    return [sum(p.numel() for p in block.parameters()) for block in model.blocks]


def split_blocks(
    block_sizes: Sequence[int], num_stages: int, blocks_per_stage: Sequence[int] | None = None
) -> list[range]:
    """Cut the block sequence into ``num_stages`` contiguous, non-empty stages; returns each stage's block indices.

    ``blocks_per_stage`` gives the split by hand (e.g. ``[2, 1]``); otherwise the split balances parameters:
    of all contiguous splits, the one whose largest stage holds the fewest parameters (``block_sizes``).
    Raises ValueError for impossible requests.
    """
    num_blocks = len(block_sizes)
    if blocks_per_stage is not None:
        if len(blocks_per_stage) != num_stages or sum(blocks_per_stage) != num_blocks or min(blocks_per_stage) < 1:
            raise ValueError(
                f"blocks_per_stage {list(blocks_per_stage)} must give each of the {num_stages} stages at least one "
                f"block and cover all {num_blocks} blocks"
            )
        bounds = [0]
        for count in blocks_per_stage:
            bounds.append(bounds[-1] + count)
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]
    if num_stages > num_blocks:
        raise ValueError(f"{num_stages} stages need at least {num_stages} blocks, the model has {num_blocks}")
    prefix = [0]
    for size in block_sizes:
        prefix.append(prefix[-1] + size)
    # largest[s][i]: the smallest possible largest stage when the first i blocks form s stages; cut[s][i]: its last cut.
    inf = float("inf")
    largest = [[inf] * (num_blocks + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (num_blocks + 1) for _ in range(num_stages + 1)]
    largest[0][0] = 0
    for stages in range(1, num_stages + 1):
        for end in range(stages, num_blocks + 1):
            for start in range(stages - 1, end):
                candidate = max(largest[stages - 1][start], prefix[end] - prefix[start])
                if candidate < largest[stages][end]:
                    largest[stages][end], cut[stages][end] = candidate, start
    ranges, end = [], num_blocks
    for stages in range(num_stages, 0, -1):
        start = cut[stages][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def block_inputs(net: BlockSequence, inputs: torch.Tensor) -> list[torch.Tensor]:
    """The meta tensors entering each block and the head, in order, for ``inputs`` (a meta tensor): the shapes a
    stage boundary carries."""
    seen: list[torch.Tensor] = []
    with torch.no_grad():
        x = net.stem(inputs)
        for block in net.blocks:
            seen.append(x)
            x = block(x)
        seen.append(x)
    return seen


def stage_modules(model: BlockSequence, stages: Sequence[range], stage: int) -> list[nn.Module]:
    """The modules stage ``stage`` runs, in order: its blocks, with the stem first on the first stage and the
    head last on the last."""
    modules = [model.blocks[index] for index in stages[stage]]
    if stage == 0:
        modules.insert(0, model.stem)
    if stage == len(stages) - 1:
        modules.append(model.head)
    return modules


def keep_only(model: BlockSequence, kept: list[nn.Module]) -> None:
    """Drop the stem, blocks and head this rank does not run (before they are ever allocated); ``nn.Identity`` in
    their place keeps the names of the others (and so the checkpoint keys) unchanged."""
    kept_ids = {id(module) for module in kept}
    for index, block in enumerate(model.blocks):
        if id(block) not in kept_ids:
            model.blocks[index] = nn.Identity()
    for name in ("stem", "head"):
        if id(getattr(model, name)) not in kept_ids:
            setattr(model, name, nn.Identity())


def place_stages(model: BlockSequence, stages: Sequence[range], devices: Sequence[torch.device]) -> None:
    """Allocate each stage's modules (built on the meta device) on its own device; ``materialize`` fills them."""
    for stage, device in enumerate(devices):
        for module in stage_modules(model, stages, stage):
            module.to_empty(device=device)


def connect_stages(model: BlockSequence, stages: Sequence[range], devices: Sequence[torch.device]) -> None:
    """Make each stage move its incoming activations to its own device (the naive, sequential pipeline)."""
    for stage, device in enumerate(devices):
        stage_modules(model, stages, stage)[0].register_forward_pre_hook(_inputs_to(device))


def _inputs_to(device: torch.device):
    def hook(module: nn.Module, args: tuple) -> tuple:
        return tuple(arg.to(device) if isinstance(arg, torch.Tensor) else arg for arg in args)

    return hook


# model.activation_checkpointing (and FSDP's own strategy.activation_checkpointing): false, true or "selective".
ActivationCheckpointing = bool | Literal["selective"]
Checkpointing = Literal["off", "selective", "full"]  # what a job does, as the plan and the search name it


def checkpointing_mode(setting: ActivationCheckpointing | None) -> Checkpointing:
    """The mode a config setting asks for: false (or null) off, true full, "selective" selective."""
    return "selective" if setting == "selective" else "full" if setting is True else "off"


def checkpointing_setting(mode: Checkpointing) -> ActivationCheckpointing:
    """The config setting that asks for ``mode`` (``checkpointing_mode``'s inverse)."""
    return "selective" if mode == "selective" else mode == "full"


# torchtitan's per-op policy (torchtitan/models/llama3/infra/parallelize.py, _save_list): the outputs of the
# compute-heavy ops are kept, all else recomputed; of the matmuls, every second is recomputed too, which halves
# what they keep for a little compute. Ours also keeps the CPU's attention kernel, the biased matmul (addmm), which
# the GPT's linear layers run as, and the experts' grouped matmul.
_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._grouped_mm.default,
    torch.ops.aten._scaled_mm.default,  # model.float8 on GPUs
}
_SAVED = _MATMULS | {
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,  # cheap to keep, and what low-precision scaling reads
}


# Whether torch hands selective checkpointing's policy each op's output (2.13; not 2.11).
_POLICY_GETS_OUTPUT = "op_output" in inspect.signature(SelectiveCheckpointContext).parameters


def _selective_contexts() -> tuple[Any, Any]:
    """The forward and recompute contexts of one block's selective checkpoint: the forward keeps what the policy
    saves (reported as ``kept_for_backward``, for the memory plan); the recompute (marked as ``recomputing``) runs
    the rest again. Torch 2.13 asks the policy in the forward only, with each op's output, and replays its answers;
    earlier versions (the GPU box's 2.11) ask before the op runs, without its output, and again in the recompute:
    the matmuls are counted apart in each, so both decide alike, and what the forward kept is counted from the
    forward context's cache once the block has run (``_kept_counted``).

    Only a simulation's recompute is marked: a real run's contexts are torch's two modes as they are, which is what
    compile requires of them (torch 2.11 asks it while AOTAutograd traces, where ``torch.compiler.is_compiling()``
    is False; the plan never compiles)."""
    matmuls = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        recompute = bool(getattr(ctx, "is_recompute", False))
        matmuls[recompute] += func in _MATMULS
        if func not in _SAVED or (func in _MATMULS and matmuls[recompute] % 2 == 0):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if not recompute and hasattr(ctx, "op_output"):
            kept_for_backward(ctx.op_output)
        return CheckpointPolicy.MUST_SAVE

    forward, recompute = create_selective_checkpoint_contexts(policy)
    if not counting():
        return forward, recompute
    return _kept_counted(forward), _recomputing_in(recompute)


@contextmanager
def _kept_counted(forward: Any) -> Iterator[None]:
    """The forward context; then, where torch gave its policy no outputs (2.11), the outputs it kept (its
    ``storage``: each op's outputs, their tensors wrapped with their versions) reported as ``kept_for_backward``."""
    with forward:
        yield
    if not _POLICY_GETS_OUTPUT:
        for kept in tree_leaves(dict(forward.storage)):
            kept_for_backward(getattr(kept, "val", kept))


@contextmanager
def _recomputing_in(mode: Any) -> Iterator[None]:
    with mode, recomputing():
        yield


def apply_activation_checkpointing(model: BlockSequence, mode: Checkpointing = "full") -> None:
    """Recompute each block's activations in backward instead of keeping them: all of them (``full``), or those
    of the cheap ops (``selective``: torchtitan's per-op policy). The recompute is marked as ``recomputing``, for
    the step's FLOPs counted without it. Parameter names, and with them checkpoints, stay as without it. Asking
    twice (model option and strategy option) applies it once.

    Full: the composable ``checkpoint`` hooks the block in place. Selective: the block's ``forward`` runs inside
    ``torch.utils.checkpoint``, below the module's hooks. Selective checkpointing replays the forward's ops in the
    recompute one for one, and FSDP's hooks, which the composable ``checkpoint`` would take into the recompute, run
    other ops there (mixed precision's input casts): outside the checkpointed region, as torchtitan's wrapper
    puts them.
    """
    if mode == "off":
        return
    for block in model.blocks:
        if checkpoint.state(block) is not None or hasattr(block.forward, "selective_context"):
            continue
        if mode == "full":
            checkpoint(block, context_fn=lambda: (nullcontext(), recomputing()))
        else:
            block.forward = _selectively_checkpointed(block.forward)


def _selectively_checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return torch_checkpoint(forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)

    checkpointed.selective_context = _selective_contexts  # type: ignore[attr-defined]  # what the plan traces
    return checkpointed


class _Waited(torch.autograd.Function):
    """A collective's result waited for (``AsyncCollectiveTensor.wait``), its gradient passed through as it is."""

    @staticmethod
    def forward(ctx: Any, pending: AsyncCollectiveTensor) -> torch.Tensor:
        return pending.wait()

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> torch.Tensor:
        return gradient


def _waiting_for_collectives(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` given its inputs as plain tensors: a collective's still pending result (tensor parallelism's
    stem hands the first block its reduce-scattered share as one) is waited for first. torch 2.13's compiled
    backward returns such an input's gradient in a form the DTensor redistribution behind it cannot take (a plain
    tensor where it reads a DTensor's; 2.11's runs it): a compiled Llama under tensor parallelism failed in its
    first backward."""

    def waited(value: Any) -> Any:
        return _Waited.apply(value) if isinstance(value, AsyncCollectiveTensor) else value

    @functools.wraps(forward)
    def waiting(*args: Any, **kwargs: Any) -> Any:
        return forward(*map(waited, args), **{name: waited(value) for name, value in kwargs.items()})

    return waiting


def compile_blocks(model: BlockSequence) -> None:
    """``torch.compile`` each block's forward, torchtitan's way: the blocks are alike, so the first compiles and the
    others reuse its code. The hooks a strategy puts on a block (FSDP's parameter gathers, activation checkpointing)
    run around the compiled forward, not inside it; parameter names, and so checkpoints, stay as without it."""
    for block in model.blocks:
        block.forward = _waiting_for_collectives(torch.compile(block.forward))


@contextmanager
def gathered_throughout(net: nn.Module) -> Iterator[None]:
    """Each FSDP unit of ``net`` gathered once on entry, kept gathered through every forward inside, and freed on
    exit: generation's many small forwards (one a token) then gather each unit once, not once a token. Without FSDP,
    nothing to do.

    FSDP2 has no getter for a unit's ``reshard_after_forward`` (``set_reshard_after_forward`` only sets it, and
    marks the root's own choice as the user's), so it is read where FSDP keeps it, each parameter group's
    ``post_forward_mesh_info`` (None: kept after forward), and put back; the root is initialised first, as its first
    forward would (its parameters then kept after forward), so that what is put back is what training runs with."""
    units = [module for module in net.modules() if isinstance(module, FSDPModule)]
    if isinstance(net, FSDPModule):
        net._get_fsdp_state()._lazy_init()
    groups = [group for unit in units for group in _param_groups(unit)]
    after_forward = [group.post_forward_mesh_info for group in groups]
    for group in groups:
        group.post_forward_mesh_info = None
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for group, mesh_info in zip(groups, after_forward, strict=True):
            group.post_forward_mesh_info = mesh_info
        for unit in units:
            unit.reshard()


def _param_groups(unit: FSDPModule) -> list[Any]:
    """A unit's FSDP parameter groups: a list in torch 2.13, one group (or None) in 2.11."""
    state = unit._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


# Compute dtype of FSDP's gathered parameters for each Trainer precision; None keeps the parameters' own dtype.
# (16-mixed is refused by the checks: Lightning's ModelParallelStrategy does not support it.)
_FSDP_PARAM_DTYPES = {"bf16-mixed": torch.bfloat16}


def fsdp_param_dtype(precision: str) -> torch.dtype | None:
    """The dtype FSDP gathers and computes parameters in under ``precision`` (the sharded masters stay fp32)."""
    return _FSDP_PARAM_DTYPES.get(precision)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    expert_shard_mesh: DeviceMesh | None = None,
) -> None:
    """Shard ``model`` with FSDP2 over ``mesh``: each block is one unit (gathered just before its own compute),
    then the root takes whatever parameters remain (embeddings, heads). Experts split over expert-parallel ranks
    (``project.parallel.expert_parallel``) are units of their own first, sharded over ``expert_shard_mesh`` (the
    ranks that hold the same experts)."""
    if isinstance(model, FSDPModule):
        return  # already sharded (Lightning may configure the model again, e.g. for validate after fit)
    options: dict[str, Any] = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy() if cpu_offload else None,
    )
    options = {key: value for key, value in options.items() if value is not None}
    # An NF4 weight (QLoRA's base) whose rows do not split into whole blocks of its quantization stays whole on
    # every rank: frozen, it has no gradient to reduce, and torchao's NF4 splits only at those blocks.
    shards = mesh.size()
    whole = {p for p in model.parameters() if is_nf4(p) and not splits_evenly(p, shards)}
    if whole:
        options["ignored_params"] = whole
    for experts in model.modules():
        if isinstance(experts, ExpertParallelMLPs):
            assert expert_shard_mesh is not None, "experts split over ranks need the mesh of their shards"
            fully_shard(experts, **{**options, "mesh": expert_shard_mesh})
    for block in cast(nn.ModuleList, model.blocks):  # a BlockSequence's, or a pipeline StageModule's
        fully_shard(block, **options)
    fully_shard(model, **options)


@torch.no_grad()
def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Where each parameter held by more than one module is held: (module, attribute name) pairs."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, parameter in module._parameters.items():
            if parameter is not None:
                places.setdefault(id(parameter), []).append((module, attr))
    return [group for group in places.values() if len(group) > 1]


def allocate(model: nn.Module, device: torch.device) -> None:
    """Give what is still on the meta device uninitialised storage on ``device``, keeping tied weights tied."""
    if any(parameter.is_meta for parameter in model.parameters()):
        shared = _shared_parameters(model)
        model.to_empty(device=device)
        # to_empty gives each module a new parameter of its own: tied weights (an output layer that is the token
        # embedding) would come apart, and train as two.
        for (module, attr), *others in shared:
            for other, other_attr in others:
                setattr(other, other_attr, getattr(module, attr))
    for parameter in model.parameters():
        if is_nf4(parameter):  # to_empty leaves parts of it on the meta device
            allocate_nf4(parameter, device)


@torch.no_grad()
def materialize(model: BlockSequence, device: torch.device, seed: int, weights: HFWeights | None = None) -> None:
    """Allocate what is still on the meta device on ``device`` and give every parameter its initial value: drawn
    from ``seed``, or read from ``weights`` (a Hugging Face model dir, ``model.init_from``).

    Strategies act on the meta model first, so by now a rank holds only what it keeps: FSDP's shards, its pipeline
    stages (whatever a strategy placed itself stays where it is). Each parameter's full initial value is computed
    on the CPU, one parameter at a time (``project.models.init``), and a sharded parameter keeps its own slice, so
    the weights depend on ``seed`` alone, not on the strategy or the device count. Read weights are read as this
    rank's slice only; LoRA's adapters, which no Hugging Face dir holds, start from ``seed`` even then. Buffers
    start at 0.
    """
    allocate(model, device)
    for buffer in model.buffers():  # the models' buffers (a router's balancing bias) start at 0
        buffer.zero_()
    parameter: torch.Tensor  # a Parameter, or (sharded) its local DTensor piece
    for name, parameter in model.named_parameters():
        if is_nf4(parameter):  # quantized whole, then sharded
            whole = torch.empty(parameter.shape, device="meta")
            fill_nf4(parameter, weights.read(name, whole) if weights else initial_value(model, name, seed))
            continue
        if weights is not None and not is_adapter(name):  # LoRA's adapters start from the seed over read weights
            value = weights.read(name, parameter).to(parameter.device)
            if isinstance(parameter, DTensor):
                parameter = parameter.to_local()
        else:
            value = initial_value(model, name, seed).to(parameter.device)
            if isinstance(parameter, DTensor):
                # src_data_rank=None: every rank slices its own copy, nothing is sent.
                value = distribute_tensor(value, parameter.device_mesh, parameter.placements, src_data_rank=None)
                value, parameter = value.to_local(), parameter.to_local()
        parameter.copy_(value)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Sequence[torch.Tensor], max_norm: float, pipeline_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Scale the gradients so that the L2 norm of the whole model's gradient is at most ``max_norm``; returns it.

    This rank's ``parameters`` may be a part of the model: sharded (FSDP's DTensors add up over their mesh) and,
    with ``pipeline_group``, one stage of several, whose squared norms add up over the group (as torchtitan's).
    """
    grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    if pipeline_group is not None:
        total_norm = total_norm**2
        dist.all_reduce(total_norm, group=pipeline_group)
        total_norm = total_norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm
