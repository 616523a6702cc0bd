"""What a training step costs besides memory: its floating-point operations, the kernels it runs (each matmul's and
attention's shape, the bytes every other op reads and writes) and the bytes of every collective it runs, counted
as each op passes through the dispatcher: what the step-time model (``project.plan.step_time``) prices. In a
memory plan's simulation that is the rank's own work on fake tensors and the fake process group (activation
checkpointing's recompute and a pipeline stage's share included); in a real run, gloo's or NCCL's collectives
(``tests/helpers/probes.py`` counts them there).

Why not torch's ``FlopCounterMode``: it tracks modules with hooks on every forward and backward, which the plan's
``MemTracker`` would see as memory; its formulas (``flop_registry``) are used as they are.
"""

import math
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# c10d's ops (the ProcessGroup's, in place; and the functional collectives DTensor runs) -> the collective's kind.
COLLECTIVES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send": "send",
}


def _query_heads(query_shape: Any, shape: Any) -> tuple[int, ...]:
    """A key's or value's shape (batch, heads, tokens, width) with the query's heads. Grouped-query attention
    broadcasts each key/value head over its group of query heads, so it computes as many products as that; torch
    2.11's formulas reject fewer key/value heads than query heads (2.13's count them this way)."""
    batch, _, tokens, width = shape
    return (batch, query_shape[1], tokens, width)


def _attention(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    key_shape, value_shape = _query_heads(query_shape, key_shape), _query_heads(query_shape, value_shape)
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _attention_backward(
    grad: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any
) -> int:
    key_shape, value_shape = _query_heads(query_shape, key_shape), _query_heads(query_shape, value_shape)
    return flop_counter.sdpa_backward_flop_count(grad, query_shape, key_shape, value_shape)


def _grouped_matmul(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any, **kwargs: Any) -> int:
    """``_grouped_mm``'s FLOPs (torch 2.13 has no formula): 2 x each output value x the inner size, which is
    ``a``'s last. Where both operands are 2-D (a weight's gradient), the inner dim is the one split into groups,
    so each group's output sums over its own part of it."""
    if len(a_shape) == len(b_shape) == 2:
        return 2 * out_shape[-2] * out_shape[-1] * a_shape[-1]
    return 2 * math.prod(out_shape) * a_shape[-1]


# torch's formulas, with _grouped_mm's, and the fused attention kernels' counted at the query's heads (torch 2.13
# has no formula for the CPU's kernel, which a simulation of a CPU job runs; 2.11's for the GPUs' refuse
# grouped-query shapes): the query, key and value are each kernel's first arguments, after the output's gradient
# backward.
FLOP_FORMULAS = {
    **flop_counter.flop_registry,
    aten._grouped_mm: flop_counter.shape_wrapper(_grouped_matmul),
    **{
        kernel: flop_counter.shape_wrapper(formula)
        for forward in (
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention,
            aten._scaled_dot_product_efficient_attention,
        )
        for kernel, formula in (
            (forward, _attention),
            (getattr(aten, f"{forward.__name__}_backward"), _attention_backward),
        )
    },
}


# The GEMMs of a step (batched, grouped or not, with a bias or not): priced by their shape (``Matmul``).
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._grouped_mm}
# Float8 GEMMs (``model.float8``): priced at the float8 peak. torchao's operands are tensor subclasses holding float8
# ``_data`` and a scale; a dispatch mode sees the GEMM on them (aten.mm) before the subclass turns it into
# ``_scaled_mm`` (or, emulated, into a matmul of the dequantized operands), so those operands mark one too.
FLOAT8_MATMULS = {aten._scaled_mm}
FLOAT8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2}


def _float8_data(tensor: torch.Tensor) -> torch.Tensor | None:
    """The float8 values a float8 training tensor (torchao's) holds, or None for any other tensor."""
    data = getattr(tensor, "_data", None)
    return data if isinstance(data, torch.Tensor) and data.dtype in FLOAT8_DTYPES else None


# Ops that move no data: views, and allocations a kernel writes later (what it writes is counted there).
# ``_unsafe_view`` is a view its schema does not declare; ops without a tensor output launch no kernel.
NO_DATA = {
    aten.empty,
    aten.empty_like,
    aten.empty_strided,
    aten.new_empty,
    aten.new_empty_strided,
    aten.detach,
    aten.lift_fresh,
    aten._unsafe_view,
    aten.alias,
}


@dataclass(frozen=True)
class Kernel:
    """A matmul or attention kernel of a step, by what prices it: ``kind`` (``matmul``, ``float8_matmul``,
    ``attention``, or ``compute`` for another op with a FLOP formula), its FLOPs and the bytes it reads and writes, its
    output ``tiles`` (a matmul's 128 x 128 output blocks, batch included: how many of a GPU's multiprocessors it keeps
    busy; 0 where not counted), the exponentials an attention kernel computes (one per score: batch x heads x queries x
    keys, forward and again in backward) and whether it is causal (its kernels skip the masked half of the products and
    scores torch's formula counts), and a matmul's output ``rows`` (its last but one dim: a CPU's cost of a matmul of
    few rows is packing its other operand, ``project.plan.step_time``). As text, a key of ``DevicePlan.kernels``:
    ``matmul|<flops>|<bytes>|<tiles>|0|0|<rows>``."""

    kind: str
    flops: int
    bytes: int
    tiles: int = 0
    exponentials: int = 0
    causal: bool = False
    rows: int = 0

    TILE = 128  # a GEMM's output tile: cuBLAS's large-GEMM tiles on A100 and H100 are 128 or 256 wide

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.flops}|{self.bytes}|{self.tiles}|{self.exponentials}|{int(self.causal)}|{self.rows}"

    @classmethod
    def parse(cls, key: str) -> "Kernel":
        kind, flops, size, tiles, exponentials, causal, rows = key.split("|")
        return cls(kind, int(flops), int(size), int(tiles), int(exponentials), causal == "1", int(rows))


def _bytes(tensors: Any) -> int:
    """What ``tensors`` hold, a float8 training tensor as its float8 values (it reports its original dtype)."""
    held = [t for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * (1 if _float8_data(t) is not None else t.element_size()) for t in held)


def _output_tiles(out: torch.Tensor) -> int:
    """128 x 128 blocks of a matmul's output (its last two dims), over its batch."""
    *batch, rows, columns = out.shape
    return math.prod(batch) * math.ceil(rows / Kernel.TILE) * math.ceil(columns / Kernel.TILE)


def _argument(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[index] if index < len(args) else kwargs.get(name, argument.default_value)
    return None


@dataclass(frozen=True)
class Link:
    """Where a collective runs: its ``kind``, the mesh dimension of its group (``data_parallel``,
    ``tensor_parallel``, ``pipeline``, as ``project.parallel.dims`` names them),
    the group's ranks and the nodes they span (what sets the bandwidth: a node's links, or the network's). As text,
    a key of ``DevicePlan.collectives``: ``all_gather|data_parallel|8|1``."""

    kind: str
    dim: str
    ranks: int
    nodes: int = 1

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.dim}|{self.ranks}|{self.nodes}"

    @classmethod
    def parse(cls, key: str) -> "Link":
        kind, dim, ranks, nodes = key.split("|")
        return cls(kind, dim, int(ranks), int(nodes))


def group_link(kind: str, group: dist.ProcessGroup, devices_per_node: int, world_dim: str) -> Link:
    """The link of a collective of ``kind`` over ``group``, ranks numbered node by node (``devices_per_node`` each),
    as torchrun and the launcher number them. A device mesh names its groups after their dimension, but uses the
    default group for a dimension of every rank: that is ``world_dim`` (``ParallelDims.world_dim``)."""
    ranks = dist.get_process_group_ranks(group)
    dim = group.group_desc.removeprefix("mesh_") if group.group_desc.startswith("mesh_") else world_dim
    return Link(kind, dim, len(ranks), len({rank // devices_per_node for rank in ranks}))


def _process_group(func: Any, args: tuple, kwargs: dict) -> dist.ProcessGroup:
    """The process group of a c10d op: a ProcessGroup (boxed as a ScriptObject) in the in-place ops, a group name
    in the functional collectives DTensor runs."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == "group_name" or "ProcessGroup" in str(argument.type):
            value: Any = args[index] if index < len(args) else kwargs[argument.name]
            if argument.name == "group_name":
                return dist.distributed_c10d._resolve_process_group(value)
            return dist.ProcessGroup.unbox(value)
    raise ValueError(f"{func} names no process group")


# True while activation checkpointing recomputes a block's forward in backward (``recomputing``): torch's checkpoint
# does not tell its recompute apart from the step's own ops.
RECOMPUTING: ContextVar[bool] = ContextVar("RECOMPUTING", default=False)


@contextmanager
def recomputing() -> Iterator[None]:
    """Marks the ops run inside as activation checkpointing's recompute (``StepCounts.recomputed_flops``)."""
    token = RECOMPUTING.set(True)
    try:
        yield
    finally:
        RECOMPUTING.reset(token)


# Set while a memory plan's simulation counts what a forward keeps for backward: selective checkpointing keeps the
# outputs its policy saves in a cache of its own, which autograd's saved-tensor hooks do not see.
KEPT_FOR_BACKWARD: ContextVar[Callable[[torch.Tensor], object] | None] = ContextVar("KEPT_FOR_BACKWARD", default=None)


def kept_for_backward(output: Any) -> None:
    """Report the tensors of ``output``, which selective checkpointing keeps, to the simulation counting them."""
    count = KEPT_FOR_BACKWARD.get()
    if count is not None:
        for tensor in tree_leaves(output):
            if isinstance(tensor, torch.Tensor):
                count(tensor)


def counting() -> bool:
    """Whether a memory plan's simulation is counting the ops run now (inside ``counting_kept``)."""
    return KEPT_FOR_BACKWARD.get() is not None


@contextmanager
def counting_kept(count: Callable[[torch.Tensor], object] | None) -> Iterator[None]:
    """Within: each tensor selective checkpointing keeps goes to ``count`` (as autograd's to a pack hook); None:
    nothing is counted (a trace's own tensors)."""
    token = KEPT_FOR_BACKWARD.set(count)
    try:
        yield
    finally:
        KEPT_FOR_BACKWARD.reset(token)


class StepCounts(TorchDispatchMode):
    """While active: ``flops``, the floating-point operations of matmuls and attention (torch's formulas), of which
    ``recomputed_flops`` activation checkpointing's recompute (MFU counts the others); ``kernels``, those ops by
    ``Kernel`` key, and ``moved_bytes``, what every other op reads and writes (views and allocations none); and
    ``collectives``, each collective's bytes by ``Link`` key (kind, mesh dimension, ranks, nodes; ``group_link``
    with ``devices_per_node`` and ``world_dim``), and ``collective_calls`` how many. In a simulation, ``fake_mode``
    is the mode of the step's fake tensors. A collective's bytes are its whole buffer: the largest of its tensors
    (the gathered tensor of an all-gather, the unreduced one of a reduce-scatter, the reduced one of an all-reduce,
    what a send sends; a receive is the other end of a send).

    ``fused`` counts as ``torch.compile`` runs a step: a chain of elementwise ops (any op but a matmul, attention or
    a collective) is one kernel, so an op does not read again what another such op wrote, and what it writes stays
    in registers unless something needs it in memory: a matmul, attention kernel or collective that reads it,
    autograd saving it for backward (``materialize``, from the simulation's pack hook), or its being alive when the
    step ends (the weights and optimizer state an update writes; ``flush``). That is a lower bound: inductor's own
    kernels move more (a norm's input read by two kernels, a backward's reductions each a kernel), so the blocks
    inductor schedules are priced by its count instead (``bytes_apart``). ``fused`` may change during a step: a
    simulation sets it while a compiled part runs (``project.plan.simulate``), the rest staying eager.

    ``host_ops`` counts what the host does to run the step (``project.plan.step_time``'s host term): ``eager``, the
    ops dispatched one by one (views and allocations too: each costs the dispatcher, and on a GPU a launch);
    ``dtensor``, the DTensors of the ops DTensor dispatches (its sharding propagation, in Python); ``compiled_kernels``,
    the kernels compiled regions launch: each matmul, attention kernel or collective, and each chain of elementwise
    ops between them (one fused kernel, Inductor's); ``compiled_calls``, the calls of compiled regions (a block's
    forward, its backward), which the simulation counts (``project.plan.simulate``)."""

    def __init__(
        self, devices_per_node: int, world_dim: str, fake_mode: FakeTensorMode | None = None, fused: bool = False
    ) -> None:
        super().__init__()
        self.devices_per_node = devices_per_node
        self.world_dim = world_dim
        self.fake_mode = fake_mode  # a simulation's: the mode of the step's tensors
        self.fused = fused
        # Inside a compiled part whose kernels' bytes inductor's scheduler counted (added as a whole by the caller):
        # its elementwise ops move nothing more here
        self.bytes_apart = False
        self.counting_collectives = True  # off for the optimizer's step (its few small all-reduces)
        self.flops = 0
        self.recomputed_flops = 0  # of which activation checkpointing's recompute
        self.kernels: Counter[str] = Counter()
        self.moved_bytes = 0
        self.collectives: Counter[str] = Counter()
        self.collective_calls: Counter[str] = Counter()
        self.host_ops: Counter[str] = Counter()
        self._chain_open = False  # inside a compiled region: an elementwise chain (one fused kernel) is under way
        self._elementwise_outputs: weakref.WeakSet = weakref.WeakSet()  # storages a fusible op wrote (``fused``)
        # Of those, the bytes not yet counted as written: a fused kernel's output nothing has needed in memory yet
        self._unwritten: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(issubclass(kind, DTensor) for kind in types):
            # As torch's CommDebugMode: let DTensor turn the op into this rank's local op and the collectives its
            # redistributions need, which then come here, rather than count the whole op.
            # DTensor's sharding propagation runs in Python over each DTensor the op takes (a fused optimizer step
            # takes every parameter at once)
            self.host_ops["dtensor"] += sum(isinstance(item, DTensor) for item in tree_leaves((args, kwargs)))
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.namespace.startswith(("c10d", "_c10d")):
            self._count_host_op(kernel=True)
            if packet.__name__ in COLLECTIVES and self.counting_collectives:
                group = _process_group(func, args, kwargs)
                link = group_link(COLLECTIVES[packet.__name__], group, self.devices_per_node, self.world_dim)
                tensors = [item for item in tree_leaves((args, kwargs)) if isinstance(item, torch.Tensor)]
                self.materialize(tensors)
                # The whole buffer (a functional all-gather, DTensor's, takes the rank's share and returns the
                # gathered tensor), a float8 tensor a byte an element.
                whole = [*tensors, *(item for item in tree_leaves(out) if isinstance(item, torch.Tensor))]
                self.collectives[link.key] += max((_bytes(t) for t in whole), default=0)
                self.collective_calls[link.key] += 1
        elif self._on_step_tensors(args, kwargs):
            formula = FLOP_FORMULAS.get(packet)
            if func.namespace != "prim":  # a tensor's metadata (prim.device), asked of fake tensors, not dispatched
                self._count_host_op(kernel=formula is not None, fusible=not func.is_view and packet not in NO_DATA)
            if formula is not None:
                self._count_compute(func, packet, formula, args, kwargs, out)
            elif not func.is_view and packet not in NO_DATA:
                self._count_moved(func, args, kwargs, out)
        return out

    def _count_host_op(self, kernel: bool, fusible: bool = False) -> None:
        """One op the host runs: eager, one dispatch; in a compiled region, a kernel of its own (``kernel``: a
        matmul, attention, a collective), the start of a fused chain (``fusible``), or nothing (a view)."""
        if not self.fused:
            self.host_ops["eager"] += 1
        elif kernel or (fusible and not self._chain_open):
            self.host_ops["compiled_kernels"] += 1
        if self.fused and (kernel or fusible):
            self._chain_open = not kernel

    def compiled_call(self) -> None:
        """A compiled region is called: its kernels start a chain of their own."""
        self.host_ops["compiled_calls"] += 1
        self._chain_open = False

    def _count_compute(self, func: Any, packet: Any, formula: Any, args: tuple, kwargs: dict, out: Any) -> None:
        self.materialize(tree_leaves((args, kwargs)))
        flops = formula(*args, **kwargs, out_val=out)
        self.flops += flops
        if RECOMPUTING.get():
            self.recomputed_flops += flops
        size = _bytes((args, kwargs)) + _bytes(out)
        if packet in MATMULS or packet in FLOAT8_MATMULS:
            operands = [item for item in tree_leaves((args, kwargs)) if isinstance(item, torch.Tensor)]
            float8 = packet in FLOAT8_MATMULS or any(_float8_data(item) is not None for item in operands)
            kind = "float8_matmul" if float8 else "matmul"
            kernel = Kernel(kind, flops, size, _output_tiles(out), rows=out.shape[-2])
        elif "attention" in packet.__name__:
            query, key = _argument(func, args, kwargs, "query"), _argument(func, args, kwargs, "key")
            scores = math.prod(query.shape[:-1]) * key.shape[-2] if query is not None and key is not None else 0
            causal = bool(_argument(func, args, kwargs, "is_causal"))
            kernel = Kernel("attention", flops, size, exponentials=scores, causal=causal)
        else:
            kernel = Kernel("compute", flops, size)
        self.kernels[kernel.key] += 1

    def _count_moved(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """The bytes an elementwise (memory-bound) op reads and writes: its tensor inputs and outputs (an in-place
        op's output is the input it writes; ``copy_`` writes its destination without reading it). An op that
        neither returns a tensor nor writes one (``prim.device``) runs no kernel; inside ``bytes_apart``, none."""
        outputs = [item for item in tree_leaves(out) if isinstance(item, torch.Tensor)]
        if self.bytes_apart or (not outputs and not func._schema.is_mutable):
            return
        inputs = [item for item in tree_leaves((args, kwargs)) if isinstance(item, torch.Tensor)]
        if func._overloadpacket is aten.copy_:
            inputs = inputs[1:]
        if not self.fused:
            self.materialize(inputs)  # an eager op reads a compiled block's output from memory
            self.moved_bytes += _bytes(inputs) + _bytes(outputs)
            return
        self.moved_bytes += _bytes([item for item in inputs if item.untyped_storage() not in self._elementwise_outputs])
        for item in outputs:
            storage = item.untyped_storage()
            self._elementwise_outputs.add(storage)
            self._unwritten[storage] = self._unwritten.get(storage, 0) + _bytes([item])

    def materialize(self, tensors: Any) -> None:
        """Count as written what a fused kernel wrote of ``tensors`` and has not been counted yet: something
        needs it in memory (``fused``)."""
        for item in tree_leaves(tensors):
            if isinstance(item, DTensor):  # saved for backward under tensor parallelism: this rank's part
                item = item._local_tensor
            if isinstance(item, torch.Tensor):
                self.moved_bytes += self._unwritten.pop(item.untyped_storage(), 0)

    def flush(self) -> None:
        """Count as written every fused kernel's output still alive: the step is over (``fused``)."""
        self.moved_bytes += sum(self._unwritten.values())
        self._unwritten.clear()

    def _on_step_tensors(self, args: tuple, kwargs: dict) -> bool:
        """Whether an op computes on the step's own tensors: not on fake tensors of another mode, which DTensor
        makes to infer an op's output shape by running it whole."""
        leaves = tree_leaves((args, kwargs))
        return all(item.fake_mode is self.fake_mode for item in leaves if isinstance(item, FakeTensor))
