"""A compiled block in a simulated step, as inductor runs it: AOTAutograd's forward and backward graphs, cut where
inductor's partitioner cuts them (``partitioned_blocks``).

``model.compile`` compiles each block's forward (``compile_blocks``). What that changes in the step's memory is
what the block keeps for its backward: inductor does not save each op's inputs as eager autograd does; its
partitioner (``min_cut_rematerialization_partition``, over the joint forward and backward graph of inductor's
decompositions) saves a cut of the forward's values, recomputing cheap elementwise ones in the backward (a norm's
output, an activation) rather than keeping them. No rule reproduces that cut: AOTAutograd makes it, on this CPU, from
fake tensors (1.6 s for a llama_1b block on the 2-core machine at load 3). Here each block shape is traced once,
with inductor's decompositions and partitioner and without its code generation (identity compilers: the graphs run
op by op), and each block of that shape runs those graphs: the simulation's tracker then sees exactly the tensors
the compiled forward saves, and its counters the ops of inductor's graphs. What inductor's kernels do inside (their
buffers between ops) does not show in saved activations, and a kernel's own buffers live only while it runs.

Each graph is also lowered by inductor and scheduled, as its compile does before generating code
(``FusedKernels``): what its kernels other than the matmuls and attention read and write, which no rule
reproduces either (a norm's input read by two kernels, a backward's reductions each a kernel of its own). That is
inductor's own count, its ``num_bytes_accessed`` metric, and the step's time prices it (``StepCounts.bytes_apart``).

A selectively checkpointed block is traced as dynamo hands it to AOTAutograd (``_as_compiled``): the checkpoint's
higher-order op, whose policy tags each op, so that the partitioner keeps what the policy saves and recomputes the
rest in the backward graph, as the compiled run does.

A block whose weights or inputs are tensor subclasses (DTensors under tensor parallelism, torchao's Float8 weights
under FSDP) is traced as AOTAutograd takes them apart, as a compiled run's: its graphs hold the local tensors, and
tensor parallelism's collectives as functional collectives, which the simulation prices as communication (they are
left out of the kernels' bytes). A block whose forward AOTAutograd cannot trace here runs eagerly, as before
(``eager_fallbacks`` names it): a forward with a data-dependent shape (a mixture's routing), for one.
"""

import copy
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from functorch.compile import min_cut_rematerialization_partition
from torch import nn
from torch._dynamo.backends.debugging import boxed_nop
from torch._functorch.aot_autograd import aot_function
from torch._guards import detect_fake_mode
from torch._higher_order_ops.wrap import tag_activation_checkpoint
from torch._inductor.debug import DebugContext
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.graph import GraphLowering
from torch._inductor.scheduler import BaseSchedulerNode, ExternKernelSchedulerNode, NopKernelSchedulerNode
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.modules import module as module_registry
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from project.accounting.counts import FLOP_FORMULAS, RECOMPUTING, counting_kept
from project.options.log_records import quieted

log = logging.getLogger(__name__)

Signature = tuple[Any, ...]
_COLLECTIVES = ("_c10d_functional", "c10d")  # priced as communication by the simulation, not as bytes moved
# Each block signature's graphs, or why AOTAutograd could not trace it: traced once a process (a plan, a search,
# simulates many steps of the same blocks).
_TRACED: dict[Signature, Callable[..., Any] | str] = {}
_SAID: set[tuple[str, str]] = set()  # (block class, why) already warned of: once a process


@dataclass(frozen=True)
class FusedKernels:
    """What inductor's scheduler makes of one compiled graph (a block's forward or its backward), without generating
    code: the kernels it fuses the ops into and those it leaves to ATen, beside the matmuls and attention, and the
    bytes those read and write (inductor's ``GraphLowering.count_bytes``, less the matmuls' and attention's, which
    are priced by shape)."""

    kernels: int
    moved_bytes: int


def _scheduled(graph_module: torch.fx.GraphModule, inputs: list[Any], backward: bool) -> FusedKernels:
    """``graph_module`` (AOTAutograd's, on fake ``inputs``) lowered and scheduled by inductor, as its compile does
    before generating code: on a copy (the plan runs the graph itself)."""
    lowering = GraphLowering(copy.deepcopy(graph_module), example_inputs=inputs, is_backward=backward)
    # (DebugContext: the scheduler writes its debug trace through it, a no-op unless inductor's tracing is on)
    with DebugContext(), V.set_graph_handler(lowering), V.set_fake_mode(detect_fake_mode(inputs)):
        lowering.run(*inputs)
        lowering._update_scheduler()
        nodes = [node for node in lowering.scheduler.nodes if _moves_bytes_apart(node)]
        return FusedKernels(len(nodes), sum(node.get_read_write_buffers_sizes() for node in nodes))


def _moves_bytes_apart(node: BaseSchedulerNode) -> bool:
    """Whether ``node`` is a kernel whose bytes the plan takes from inductor: one it generates, or an op it leaves
    to ATen or a library (a fallback: complex numbers, for one, which it generates no code for) that is neither a
    view nor a matmul or attention, which the simulation prices by their shapes (the ops with a FLOP formula)."""
    if isinstance(node, NopKernelSchedulerNode):
        return False
    if not isinstance(node, ExternKernelSchedulerNode):
        return True
    op = getattr(node.node, "op_overload", None)  # none on a multi-output kernel's outputs (counted with it)
    return (
        isinstance(op, torch._ops.OpOverload)
        and not op.is_view
        and op.overloadpacket not in FLOP_FORMULAS
        and op.namespace not in _COLLECTIVES
    )


# Each block signature's forward and backward as inductor schedules them (traced with ``_TRACED``).
_SCHEDULED: dict[Signature, tuple[FusedKernels, FusedKernels]] = {}


def _tensor_signature(tensor: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's shape, strides, dtype and whether it requires grad; a subclass's class, its layout (a DTensor's
    placements) and its inner tensors'; a DTensor's mesh, its process groups included, which its graph's
    collectives name (a plan of another world in the same process has other groups)."""
    signature = (tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.requires_grad)
    if not is_traceable_wrapper_subclass(tensor):
        return signature
    names, context = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]  # (torch 2.13's DTensor lists its mesh among them)
    mesh = _mesh_signature(tensor.device_mesh) if isinstance(tensor, DTensor) else None
    return (
        type(tensor),
        *signature,
        repr(context),
        mesh,
        tuple(_tensor_signature(value) if isinstance(value, torch.Tensor) else repr(value) for value in inner),
    )


def _mesh_signature(mesh: DeviceMesh) -> tuple[Any, ...]:
    groups = tuple(mesh.get_group(dim).group_name for dim in range(mesh.ndim))
    return (tuple(mesh.shape), mesh.mesh_dim_names, groups)


def _signature(
    block: nn.Module, forward: Callable[..., Any], tensors: dict[str, torch.Tensor], args: tuple
) -> Signature:
    """What a block's traced graphs depend on: its modules' classes and settings (the plain attributes of each:
    widths, head counts, RoPE's base), whether its ``forward`` is selectively checkpointed, its parameters' and
    inputs' shapes, strides and dtypes, and the autocast and grad modes they run under."""
    settings = tuple(
        (name, key, repr(value))
        for name, module in block.named_modules()
        for key, value in sorted(vars(module).items())
        if not key.startswith("_") and isinstance(value, int | float | str | bool | tuple | type(None))
    )
    return (
        tuple((name, type(module)) for name, module in block.named_modules()),
        settings,
        hasattr(forward, "selective_context"),
        tuple((name, _tensor_signature(tensor)) for name, tensor in tensors.items()),
        tuple(_tensor_signature(arg) if isinstance(arg, torch.Tensor) else repr(arg) for arg in args),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_grad_enabled(),
    )


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A fake tensor of the mode in force, shaped as ``tensor``; a tensor subclass (DTensor, torchao's Float8
    weight) rebuilt around fresh inner tensors, as AOTAutograd takes it apart."""
    if is_traceable_wrapper_subclass(tensor):
        names, context = tensor.__tensor_flatten__()
        inner = {name: getattr(tensor, name) for name in names}  # (torch 2.13's DTensor lists its mesh too)
        inner = {name: _fresh(t).detach() if isinstance(t, torch.Tensor) else t for name, t in inner.items()}
        made = type(tensor).__tensor_unflatten__(inner, context, tensor.shape, tensor.stride())
    else:
        made = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
    return made.requires_grad_(tensor.requires_grad)


def _as_compiled(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` as dynamo hands it to AOTAutograd. A selectively checkpointed one (``selective_context``, its
    checkpoint's contexts: ``project.parallel.parallelize``) becomes the checkpoint's higher-order op over the
    block's own forward, a graph of one call, as dynamo makes it: under AOTAutograd the op runs the checkpoint with
    its policy tagging each op it traces (saved, or recomputed), and the partitioner keeps the saved ones and puts
    the others' recompute in the backward graph."""
    context_fn = getattr(forward, "selective_context", None)
    if context_fn is None:
        return forward
    inner = forward.__wrapped__  # type: ignore[attr-defined]

    def checkpointed(*args: Any) -> Any:
        graph = torch.fx.Graph()
        graph.output(graph.call_function(inner, tuple(graph.placeholder(f"arg{i}") for i in range(len(args)))))
        body = torch.fx.GraphModule({}, graph)
        body.meta["_checkpoint_context_fn"] = context_fn
        return tag_activation_checkpoint(body, *args)

    return checkpointed


def _recomputes_marked(graph_module: torch.fx.GraphModule) -> None:
    """A backward graph's recompute of forward ops (copied by the partitioner with their checkpoint's ``recompute``
    tag) runs marked as ``recomputing``, as an eager recompute is: the step's model FLOPs leave it out."""
    tokens = []

    def begins() -> None:
        tokens.append(RECOMPUTING.set(True))

    def ends() -> None:
        RECOMPUTING.reset(tokens.pop())

    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.meta.get("recompute") is not None:
            with graph.inserting_before(node):
                graph.call_function(begins)
            with graph.inserting_after(node):
                graph.call_function(ends)
    graph_module.recompile()


# The module hooks every module call runs (torch.nn.modules.module's registries, which torch's memory trackers fill):
# the trace calls the block's modules on tensors of its own, which those hooks must not follow.
_GLOBAL_MODULE_HOOKS = [
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
]


@contextmanager
def _without_global_module_hooks() -> Iterator[None]:
    saved = {name: dict(getattr(module_registry, name)) for name in _GLOBAL_MODULE_HOOKS}
    for name in _GLOBAL_MODULE_HOOKS:
        getattr(module_registry, name).clear()
    try:
        yield
    finally:
        for name, hooks in saved.items():
            getattr(module_registry, name).update(hooks)


class PartitionedBlocks:
    """Compiled blocks run as their AOTAutograd graphs, one trace per block signature (``_signature``)."""

    def __init__(self) -> None:
        self.eager_fallbacks: dict[str, str] = {}  # block class -> why it ran eagerly
        self.forwards: dict[nn.Module, Callable[..., Any]] = {}  # each block's own forward, as it was

    def fall_back(self, block: nn.Module, why: str) -> None:
        """``block`` runs eagerly in the plan, for ``why``: said once a block class and reason in a process (a plan
        simulates several steps)."""
        name, why = type(block).__name__, why.splitlines()[0]
        self.eager_fallbacks.setdefault(name, why)
        if (name, why) not in _SAID:
            _SAID.add((name, why))
            log.warning(
                "model.compile: %s planned as eager: %s. Its saved activations are eager autograd's, "
                "which inductor's partition may keep fewer of.",
                name,
                why,
            )

    def _trace(
        self, forward: Callable[..., Any], block: nn.Module, tensors: dict, args: tuple, key: Signature
    ) -> Callable[..., Any] | str:
        """``forward`` of ``block`` compiled by AOTAutograd as inductor calls it, traced on fresh fake tensors with the
        simulation's own modes (its tracker, counters and fake tensors) set aside, so that tracing counts nothing; or
        why it could not be traced. Its two graphs scheduled by inductor too (``_SCHEDULED``), where it can."""

        compiled_forward = _as_compiled(forward)

        def functional(tensors: dict[str, torch.Tensor], *args: Any) -> Any:
            with _reparametrize_module(block, tensors):
                return compiled_forward(*args)

        scheduled: list[FusedKernels] = []
        unscheduled: list[str] = []

        def compiler(backward: bool) -> Any:
            # aot_eager's compiler: the graph runs op by op, each input freed after its last use, as inductor's code
            # frees it (plain calls would keep every saved tensor until the backward's end)
            def compile_graph(graph_module: torch.fx.GraphModule, inputs: list[Any]) -> Any:
                try:
                    scheduled.append(_scheduled(graph_module, list(inputs), backward))
                except Exception as error:  # noqa: BLE001  (any failure to schedule: its bytes by the rule)
                    unscheduled.append(f"{type(error).__name__}: {error}")
                if backward:
                    _recomputes_marked(graph_module)
                return boxed_nop(graph_module, inputs)

            return compile_graph

        compiled = aot_function(
            functional,
            fw_compiler=compiler(backward=False),
            bw_compiler=compiler(backward=True),
            partition_fn=min_cut_rematerialization_partition,
            decompositions=select_decomp_table(),
        )
        # Nothing of the trace reaches the step: not the simulation's modes, nor the saved-tensor hooks in force (an
        # activation checkpoint's, which would count the trace's tensors as the block's), nor its count of what a
        # selective checkpoint keeps. (Torch warns, once, that a checkpoint's policy under compile must meet no
        # in-place op: the run's compile warns of its own.)
        identity = torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor)
        with (
            _disable_current_modes(),
            _without_global_module_hooks(),
            FakeTensorMode(),
            identity,
            counting_kept(None),
            quieted("torch._higher_order_ops.wrap"),
        ):
            fresh_tensors = {name: _fresh(tensor) for name, tensor in tensors.items()}
            fresh_args = tuple(_fresh(arg) if isinstance(arg, torch.Tensor) else arg for arg in args)
            try:
                # The first call traces and runs forward; a backward compiles the backward graph here, not lazily
                # inside the step's modes.
                outputs = [
                    output
                    for output in tree_leaves(compiled(fresh_tensors, *fresh_args))
                    if isinstance(output, torch.Tensor) and output.requires_grad
                ]
                torch.autograd.backward(outputs, [torch.ones_like(output) for output in outputs])
            except Exception as error:  # noqa: BLE001  (any failure to trace: the block runs eagerly, named)
                return f"AOTAutograd could not trace it ({type(error).__name__}: {error})"
        if len(scheduled) == 2:
            _SCHEDULED[key] = (scheduled[0], scheduled[1])
        else:
            self.fall_back_bytes(block, unscheduled[0] if unscheduled else "no backward graph")
        return compiled

    def fall_back_bytes(self, block: nn.Module, why: str) -> None:
        """``block``'s kernels' bytes are counted by the rule (``StepCounts.fused``), for ``why``: said once."""
        name, why = type(block).__name__, why.splitlines()[0]
        if (name, why) not in _SAID:
            _SAID.add((name, why))
            log.warning("model.compile: %s's kernels not scheduled by inductor (%s); their bytes by rule.", name, why)

    def _traced(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[Signature, Callable[..., Any]] | str:
        """``block``'s signature on ``args`` and its traced graphs (traced on the first call of the signature), or
        why it runs eagerly."""
        tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
        if kwargs:
            return f"called with keyword arguments {sorted(kwargs)}"
        key = _signature(block, self.forwards[block], tensors, args)
        if key not in _TRACED:
            _TRACED[key] = self._trace(self.forwards[block], block, tensors, args, key)
        compiled = _TRACED[key]
        return compiled if isinstance(compiled, str) else (key, compiled)

    def scheduled(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[FusedKernels, FusedKernels] | None:
        """How inductor schedules ``block``'s forward and backward on ``args`` and ``kwargs`` (traced here if not
        yet), or None: it runs eagerly, or its graphs could not be scheduled."""
        traced = self._traced(block, args, kwargs) if block in self.forwards else "not compiled"
        return None if isinstance(traced, str) else _SCHEDULED.get(traced[0])

    def forward_of(self, block: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        """``block``'s forward as its compiled graphs run it (``forward`` itself where they cannot)."""
        self.forwards[block] = forward

        def partitioned(*args: Any, **kwargs: Any) -> Any:
            traced = self._traced(block, args, kwargs)
            if isinstance(traced, str):
                self.fall_back(block, traced)
                return forward(*args, **kwargs)
            tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
            with torch.autocast("cpu", enabled=False):  # the graphs hold autocast's casts already
                return traced[1](tensors, *args)

        return partitioned


@contextmanager
def partitioned_blocks(blocks: list[nn.Module]) -> Iterator[PartitionedBlocks]:
    """While inside, each of ``blocks`` runs its forward as compiled (``PartitionedBlocks``)."""
    partitioned = PartitionedBlocks()
    replaced = {}  # block -> its own forward attribute (a wrapper a strategy set), or None: the class's
    for block in blocks:
        replaced[block] = vars(block).get("forward")
        block.forward = partitioned.forward_of(block, block.forward)  # type: ignore[method-assign]
    try:
        yield partitioned
    finally:
        for block, forward in replaced.items():
            if forward is None:
                del block.forward
            else:
                block.forward = forward  # type: ignore[method-assign]
