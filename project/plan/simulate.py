"""One device's training step on fake tensors (``simulate``): what the memory plan runs for each distinct device of
a job, as its layout lays the device out (``Layout.simulated_devices``).

The device's parameters are allocated as fake tensors (shapes and dtypes, no memory), the optimizer makes its state,
and a training step runs on them under PyTorch's ``MemTracker``, in Lightning's order (forward, zero_grad, backward,
optimizer step), at the job's batch, sequence length and precision. The tracker follows every tensor's storage as
it is made and freed: its peak is the device's peak; parameters, gradients and optimizer state are counted from the
device's tensors after the step, as ``project.observability.DeviceMemory`` counts a real run's. The step's FLOPs and
collectives are counted beside (``project.accounting.counts``).
"""

import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.distributed.tensor import DTensor, _sharding_prop
from torch.distributed.tensor.parallel import loss_parallel

from project.accounting.counts import RECOMPUTING, StepCounts, counting_kept
from project.accounting.memory_trackers import (
    OverCapacity,
    StepFSDPMemTracker,
    StepMemoryTracker,
    held_bytes,
    model_state_bytes_per_device,
)
from project.job.job import Job
from project.job.layout import DeviceWork
from project.job.task import TaskModule
from project.models.float8 import fake_scales_flattened
from project.models.kv_cache import KeyValueCache
from project.parallel.parallelize import allocate, gathered_throughout
from project.plan.compiled_blocks import FusedKernels, partitioned_blocks
from project.plan.cuda_kernels import cuda_kernels

# What FSDPMemTracker counts as FSDP's communication: gathered parameters and the buffers of the collectives.
FSDP_COMMUNICATION = (_FSDPRefType.UNSHARDED_PARAM, _FSDPRefType.ALL_GATHER, _FSDPRefType.REDUCE_SCATTER)
# The compute dtype of Lightning's mixed precisions (autocast): the CPU's autocast in the simulation, run by CUDA's
# lists for a job on GPUs (project.plan.cuda_kernels).
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass
class DevicePlan:
    """Bytes one device needs. ``activations``: what autograd saves for backward over the forwards in flight;
    ``comm_buffers``: held for communication (DDP's buckets, a pipeline's receive buffers; FSDP's gathered
    parameters and collective buffers at the peak); ``peak``: the most the device holds at once in a step."""

    name: str
    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    peak: int
    activations_checkpointed: int | None = None  # the same with the other activation checkpointing setting...
    peak_checkpointed: int | None = None  # ...and its peak (plan=true only)
    flops: int = 0  # floating-point operations of the step on this device (project.accounting.counts)...
    recomputed_flops: int = 0  # ...of which activation checkpointing's recompute
    moved_bytes: int = 0  # read and written by its memory-bound ops (all but matmuls, attention, collectives)
    kernels: dict[str, int] = field(default_factory=dict)  # its matmul and attention kernels: count by Kernel key
    collectives: dict[str, int] = field(default_factory=dict)  # bytes of the step's collectives, by Link key...
    collective_calls: dict[str, int] = field(default_factory=dict)  # ...and how many
    host_ops: dict[str, int] = field(default_factory=dict)  # what the host runs: StepCounts.host_ops, and
    # "fsdp_modules", the FSDP-wrapped modules whose hooks run each step
    kept: int = 0  # held throughout beside the model state: the task's copy of its initial weights (in ``peak``)

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(tensor.untyped_storage().nbytes() for tensor in tensors)


@contextmanager
def _simulated_device(work: DeviceWork, job: Job) -> Iterator[tuple[FakeTensorMode, torch.optim.Optimizer]]:
    """Inside: ``work``'s net allocated as fake tensors, at the job's precision, with CUDA's kernels for a job on
    GPUs, as after a first step: the optimizer's state made, the gradients there. Yields the fake mode and the
    optimizer."""
    precision = job.precision
    module, net = work.module, work.module.net
    if precision in ("bf16-true", "16-true"):  # Lightning's HalfPrecision converts the module
        # On the meta device, before the fake tensors: torch cannot swap a fake parameter for its converted copy.
        net.to(torch.bfloat16 if precision == "bf16-true" else torch.float16)
    with (
        FakeTensorMode(allow_non_fake_inputs=True) as fake_mode,
        cuda_kernels() if job.on_gpus else nullcontext(),
        fake_scales_flattened(),
        warnings.catch_warnings(),
    ):
        # torchao's NF4 (QLoRA's base) checks FSDP's gathered buffers by their data pointers, which fake tensors
        # have none of (they compare equal, and torch warns).
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor", UserWarning)
        # FSDP2 warns when a module it wraps returns a view (an in-place op on it would skip the module's gradient
        # hook). The simulation's pipeline stages and their embedding and head under FSDP return views of its fake
        # buffers; nothing changes them in place, and real runs of those layouts print no such warning.
        warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(.*\) returned a view tensor", UserWarning)
        allocate(net, torch.device("cpu"))
        if module.precomputation is not None:  # what a run computes before its first step (DPO's reference): their
            # values change no shape, byte or FLOP of the step; kept outside it, as a run keeps them before it
            module.precomputed = torch.zeros(job.train_samples + job.val_samples, job.data.sequences_per_sample)
        optimizer = module.new_optimizer()
        # As after a first step: the optimizer's state (a step on zero gradients makes it, without a forward) and
        # the gradients, which Lightning frees only after the next forward.
        for parameter in net.parameters():
            if parameter.requires_grad:  # a frozen one (LoRA's base) has none
                parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
        yield fake_mode, optimizer


def _tracker(net: nn.Module, optimizer: torch.optim.Optimizer, stop_above: int | None) -> MemTracker:
    """The step's memory tracker: FSDP's (which also tells its gathers and reductions apart) or the plain one."""
    tracker: MemTracker
    if isinstance(net, FSDPModule):
        tracker = StepFSDPMemTracker(net, optimizer)
    else:
        tracker = StepMemoryTracker()
        tracker.track_external(net, optimizer)
    tracker.stop_above = stop_above
    return tracker


def _fsdp_communication(tracker: MemTracker) -> int:
    """The bytes of FSDP's gathered parameters and collective buffers at the peak."""
    at_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return sum(at_peak.get(kind, 0) for kind in FSDP_COMMUNICATION)


def simulate(work: DeviceWork, job: Job, world_dim: str, stop_above: int | None = None) -> DevicePlan:
    """A training step of ``work`` on fake tensors under ``MemTracker``, the optimizer's state already made (so,
    a second step, which holds the most), with CUDA's kernels for a job on GPUs (``cuda_kernels``): the device's
    bytes, FLOPs and collectives (``world_dim``: the mesh dimension of the collectives over every rank,
    ``ParallelDims.world_dim``). With ``stop_above``, the step stops
    at the first moment the device holds more: its peak is then just above it, and its activations, FLOPs and
    collectives those counted up to there."""
    module, net = work.module, work.module.net
    with _simulated_device(work, job) as (fake_mode, optimizer):
        tracker = _tracker(net, optimizer, stop_above)
        saved: dict[Any, int] = {}  # storage -> bytes, of the tensors saved for backward that are not parameters
        held: list[torch.Tensor] = []  # for the whole run: communication buffers
        input_buffers: list[torch.Tensor] = []
        grad_buffers: list[torch.Tensor] = []
        # Counted: the forward and backward (what a run's training_step and backward run); not the optimizer's
        # step, whose only collectives are a few small all-reduces of tensor-parallel norms' gradients.
        counts = StepCounts(job.devices, world_dim, fake_mode)
        activations: int | None = None
        kept: list[torch.Tensor] = []  # what the task keeps of the initial weights
        compiled = _fused_in_compiled(net, module, counts) if job.model.compile else nullcontext()
        with tracker, _dtensor_shapes_inferred_apart(), compiled:
            try:
                # Made inside the tracker, which counts them then (FSDP's takes no tensors made before it).
                kept = module.keep_initial_weights()
                if work.extra_buffer_bytes:
                    held.append(torch.empty(work.extra_buffer_bytes, dtype=torch.uint8))
                # A pipeline stage's receive buffers, one per micro-batch: for its inputs, and for its outputs'
                # gradients.
                input_buffers, grad_buffers = (
                    [torch.empty_like(meta, device="cpu") for _ in range(work.microbatches)]
                    if work.receive_buffers and meta is not None
                    else []
                    for meta in (work.stage_input, work.stage_output)
                )
                # The batch on the device: Lightning moves the whole batch to every rank's device, and on a CPU the
                # data loader's next batch, fetched one ahead, is there too. A micro-batch is a view of it.
                batches = [job.data.example_batch(job.batch_size) for _ in range(1 if job.on_gpus else 2)]
                rows = work.microbatch_size * job.data.sequences_per_sample  # a preference pair is two rows
                microbatch = tuple(tensor[:rows] for tensor in batches[0])
                with counts:
                    activations = _step(
                        work, module, optimizer, microbatch, input_buffers, grad_buffers, tracker, counts, job, saved
                    )
                    counts.counting_collectives = False  # the optimizer's bytes, for the step's time
                    optimizer.step()
                    counts.flush()
            except OverCapacity:  # it does not fit, whatever the rest of the step holds
                pass
            comm_bytes = _storage_bytes(held + input_buffers + grad_buffers)
            if work.grads_persist:
                comm_bytes += sum(_storage_bytes([p.grad]) for p in net.parameters() if p.grad is not None)
        if activations is None:  # stopped within the step: what was saved up to there
            activations = sum(saved.values())
        sizes = model_state_bytes_per_device(net, [optimizer]).get(0, {"params": 0, "grads": 0, "optimizer": 0})
        peak = held_bytes(tracker, "peak")
        comm_bytes += _fsdp_communication(tracker)
    # What the simulation does not run: DDP's all-reduce of the gradients (no DDP wrapper), a pipeline's sends.
    counted = counts.collectives + Counter(work.unsimulated_collectives)
    calls = counts.collective_calls + Counter(work.unsimulated_calls)
    return DevicePlan(
        work.name,
        sizes["params"],
        sizes["grads"],
        sizes["optimizer"],
        activations,
        comm_bytes,
        peak,
        flops=counts.flops,
        recomputed_flops=counts.recomputed_flops,
        moved_bytes=counts.moved_bytes,
        kernels=dict(sorted(counts.kernels.items())),
        collectives={kind: counted[kind] for kind in sorted(counted) if counted[kind]},
        collective_calls={kind: calls[kind] for kind in sorted(calls) if counted[kind]},
        host_ops={**counts.host_ops, "fsdp_modules": sum(isinstance(part, FSDPModule) for part in net.modules())},
        kept=_storage_bytes(kept),
    )


@dataclass
class GenerationPlan:
    """A step's generation on one device (``Job.generation``; ``simulate_generation``): its peak, of which the
    key/value cache and FSDP's gathered parameters; and its work in three parts, each a ``DevicePlan`` of counts:
    gathering the model once (``gather``), one prompt's pass over its group's rows (``prompt_pass``), and one
    pass of one token a row (``token_pass``), of which a step runs ``prompts`` and ``prompts`` x (``new_tokens`` -
    1); and where the task asks for it (``Generation.reference_pass``), one forward over the step's rows, the model
    gathered for it (``reference_pass``)."""

    peak: int
    cache: int
    gathered: int
    prompts: int
    new_tokens: int
    gather: DevicePlan
    prompt_pass: DevicePlan
    token_pass: DevicePlan
    reference_pass: DevicePlan | None = None


def generation_flops(generation: GenerationPlan) -> int:
    """A step's generation's FLOPs: its prompts' passes and their one-token passes, and the reference's pass."""
    passes = generation.prompt_pass.flops + (generation.new_tokens - 1) * generation.token_pass.flops
    reference = generation.reference_pass.flops if generation.reference_pass is not None else 0
    return generation.prompts * passes + reference


def simulate_generation(work: DeviceWork, job: Job, world_dim: str) -> GenerationPlan:
    """The generation inside a training step of ``work`` (``job.generation``), on fake tensors: the model state as
    the step starts (the optimizer's state, the last step's gradients), FSDP's units gathered for the whole draw
    (``gathered_throughout``), a prompt at its longest over the group's rows, then one token a row over the full
    cache (its buffers are made whole at the prompt's pass): its peak. Its counts: the gathers, the prompt's pass,
    and the middle one-token pass, whose attention reads the mean of the passes' keys (prompt + new_tokens / 2;
    they grow by one a pass). Then, with ``reference_pass``, the net's forward over a step's rows, gathered again (the
    task's reading of the logits left out: the training step reads the same logits, and keeps more)."""
    generation = job.generation
    assert generation is not None, "a task that generates"
    net = work.module.net
    autocast_dtype = AUTOCAST_DTYPES.get(job.precision)
    autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    parts: list[_Tally] = []
    with _simulated_device(work, job) as (fake_mode, optimizer):
        # The plain tracker: FSDP's tracks one forward per module (a pass a token is many).
        tracker = StepMemoryTracker()
        tracker.track_external(net, optimizer, *work.module.keep_initial_weights())
        counts = StepCounts(job.devices, world_dim, fake_mode)
        net.eval()
        with tracker, _dtensor_shapes_inferred_apart(), counts, torch.no_grad(), autocast:
            start, before = _Tally.of(counts), held_bytes(tracker)
            with gathered_throughout(net):
                parts.append(_Tally.of(counts).minus(start))
                gathered = held_bytes(tracker) - before
                cache = KeyValueCache(len(net.blocks), generation.prompt_tokens + generation.new_tokens)
                start = _Tally.of(counts)
                net(torch.zeros(generation.sequences, generation.prompt_tokens, dtype=torch.long), cache=cache)
                parts.append(_Tally.of(counts).minus(start))
                for layer in cache.layers:
                    layer.length = generation.prompt_tokens + generation.new_tokens // 2 - 1
                start = _Tally.of(counts)
                net(torch.zeros(generation.sequences, 1, dtype=torch.long), cache=cache)
                parts.append(_Tally.of(counts).minus(start))
                buffers = [tensor for layer in cache.layers for tensor in (layer.keys, layer.values)]
                cached = _storage_bytes([tensor for tensor in buffers if tensor is not None])
                del cache
            if generation.reference_pass:
                start = _Tally.of(counts)
                rows = work.microbatch_size * job.data.sequences_per_sample
                with gathered_throughout(net):
                    net(job.data.example_batch(job.batch_size)[0][:rows])
                parts.append(_Tally.of(counts).minus(start))
        peak = held_bytes(tracker, "peak")
        sizes = model_state_bytes_per_device(net, [optimizer]).get(0, {"params": 0, "grads": 0, "optimizer": 0})
    gather, prompt_pass, token_pass, *reference = (part.device_plan(work.name, sizes) for part in parts)
    return GenerationPlan(
        peak, cached, gathered, job.batch_size, generation.new_tokens, gather, prompt_pass, token_pass, *reference
    )


@contextmanager
def _fused_in_compiled(net: nn.Module, module: TaskModule, counts: StepCounts) -> Iterator[None]:
    """While inside: ``counts`` counts the blocks' forward and backward as compiled (``StepCounts.fused``), as
    ``model.compile`` compiles them (``compile_blocks``), and the loss where the task compiles it
    (``compiled_loss_module``: the criterion of plain logits, or the fused loss's head); the rest (embedding, head,
    optimizer, a tensor-parallel loss) as eager. A block's forward and backward run as AOTAutograd's graphs
    (``partitioned_blocks``), and the bytes their fused kernels move are inductor's count of them (``FusedKernels``),
    added at each call, the rule counting none inside (``StepCounts.bytes_apart``); where inductor could not schedule
    a block, and for the loss, the rule's.
    Forward: a block's hooks around its forward. Backward: a block's starts when its output's gradient is computed
    and ends when its input's is; between two blocks, the one tensor is the first's output and the second's input,
    so a depth (+1 at an output, -1 at an input) stays inside from the last block's output to the first's input.
    The loss likewise, from its output's gradient (backward's start) to its logits'. Each forward and each
    backward of a compiled part is one call of compiled code (``StepCounts.compiled_call``)."""
    depth = 0
    apart = 0  # of that depth, inside parts whose bytes inductor counted
    calls: dict[nn.Module, tuple[FusedKernels, FusedKernels] | None] = {}  # each block's forward under way

    def entering(scheduled: bool) -> Callable[..., None]:
        def enter(*_: Any) -> None:
            nonlocal depth, apart
            depth, apart = depth + 1, apart + scheduled
            counts.fused, counts.bytes_apart = depth > 0, apart > 0

        return enter

    def leaving(scheduled: bool) -> Callable[..., None]:
        def leave(*_: Any) -> None:
            nonlocal depth, apart
            depth, apart = depth - 1, apart - scheduled
            counts.fused, counts.bytes_apart = depth > 0, apart > 0

        return leave

    def before(block: nn.Module, args: tuple, kwargs: dict) -> None:
        if block is loss and isinstance(args[0], DTensor):
            return  # split logits: the loss stays eager (TokenCrossEntropy)
        kernels = calls[block] = partitioned.scheduled(block, args, kwargs)
        counts.compiled_call()  # the compiled forward
        if kernels is not None:
            counts.moved_bytes += kernels[0].moved_bytes
        if RECOMPUTING.get():  # activation checkpointing's recompute, inside the block's backward: already there
            return
        for item in args:
            if isinstance(item, torch.Tensor) and item.requires_grad:
                item.register_hook(leaving(kernels is not None))
        entering(kernels is not None)()

    def backward_of(kernels: tuple[FusedKernels, FusedKernels] | None) -> Callable[..., None]:
        def backward_starts(*_: Any) -> None:
            counts.compiled_call()  # the compiled backward
            entering(kernels is not None)()
            if kernels is not None:
                counts.moved_bytes += kernels[1].moved_bytes

        return backward_starts

    def after(block: nn.Module, args: tuple, output: Any) -> None:
        if block is loss and isinstance(args[0], DTensor):
            return
        kernels = calls.pop(block)
        if RECOMPUTING.get():
            return
        leaving(kernels is not None)()
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(backward_of(kernels))
            if not any(isinstance(item, torch.Tensor) and item.requires_grad for item in args):
                # No input's gradient ends its backward (a frozen embedding's output under LoRA): its own backward's
                # end does (a compiled block's backward is one autograd node).
                assert output.grad_fn is not None
                output.grad_fn.register_hook(leaving(kernels is not None))

    loss = module.compiled_loss_module()
    blocks = list(getattr(net, "blocks", []))
    compiled = [*blocks, *([loss] if loss is not None else [])]
    with partitioned_blocks(blocks) as partitioned:
        handles = [
            hook
            for part in compiled
            for hook in (
                part.register_forward_pre_hook(before, with_kwargs=True),
                part.register_forward_hook(after),
            )
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            counts.fused = counts.bytes_apart = False


@contextmanager
def _dtensor_shapes_inferred_apart() -> Iterator[None]:
    """DTensor infers each op's output shape by running the op on fake tensors of the fake mode in force (torch
    2.13: ``detect_fake_mode() or FakeTensorMode()``): here the simulation's own, where the tracker would count
    them as the step's memory, at global shapes (for Llama 3 8B split 8 ways: a whole vocabulary's logits, twice).
    Outside a simulation DTensor makes a fresh mode for it, which no tracker sees; so it does here."""
    detect_fake_mode = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda: None  # type: ignore[assignment,misc]  # torch calls it without arguments
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = detect_fake_mode


def _step(
    work: DeviceWork,
    module: TaskModule,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, ...],  # (inputs, targets)
    input_buffers: list[torch.Tensor],
    grad_buffers: list[torch.Tensor],
    tracker: MemTracker,
    counts: StepCounts,
    job: Job,
    saved: dict[Any, int],
) -> int:
    """A training step in Lightning's order up to the optimizer's step (the caller's): forward
    (``training_step``), ``zero_grad``, backward; a pipeline's forwards run inside its backward, after
    ``zero_grad``, in its schedule's order, its micro-batches outside ``simulated_microbatches`` replayed.
    Returns the bytes autograd saved for backward in the forwards in flight at once (each storage once,
    parameters and views of them not counted); ``saved`` gathers them, storage by storage."""
    data_inputs, target = batch
    autocast_dtype = AUTOCAST_DTYPES.get(job.precision)
    autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    # With gradient accumulation, the step that holds the most is a later one of the accumulation: Lightning does
    # not zero the gradients there, so the previous batches' are held through the forward and backward.
    accumulating = job.accumulate > 1
    zero_grad = lambda: accumulating or optimizer.zero_grad(set_to_none=not work.grads_persist)  # noqa: E731
    if work.forward_in_backward:
        zero_grad()

    def storage_of(tensor: torch.Tensor) -> Any:
        # A tensor-parallel activation is a DTensor: its bytes are this rank's part (its local tensor).
        return (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).untyped_storage()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        counts.materialize(tensor)  # kept for backward: in memory, written by a fused kernel too
        if not isinstance(tensor, nn.Parameter) and not isinstance(tensor._base, nn.Parameter):  # a linear saves W.T
            storage = storage_of(tensor)
            # A compiled block's graph saves its weights as aliases of their storage (torch 2.11), and FSDP's
            # parameters in a forward are plain tensors: a weight's storage is the model's, not an activation.
            if storage._cdata not in {storage_of(parameter)._cdata for parameter in module.net.parameters()}:
                saved[storage._cdata] = storage.nbytes()
        return tensor

    pending: list[tuple[int, torch.Tensor]] = []  # micro-batches whose backward is still to run, oldest first
    simulated = simulated_microbatches(work.microbatches, min(work.in_flight, work.microbatches))
    repeat = _Repeat()  # micro-batch 1's effects, which a replayed micro-batch repeats

    def forward(index: int) -> None:
        if index not in simulated:
            repeat.forward(index, pending, saved, counts)
            return
        if index == 1:
            repeat.before(tracker, counts, saved)
        if work.stage_input is None:
            x = data_inputs
        elif input_buffers:
            x = input_buffers[index].detach().requires_grad_()
        else:  # arrives from the previous device
            x = torch.empty_like(work.stage_input, device="cpu").requires_grad_()
        with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), counting_kept(pack):
            *earlier, final = work.stages
            for stage in earlier:
                x = stage(x)
            if work.last:  # the loss as the task computes it (of the logits, or in the head: fused_loss); nothing
                # kept of it but its value, as in the strategies
                loss = module.loss(module.net_outputs(final, x, target), target).value / work.microbatches
                pending.append((index, loss))
            else:
                pending.append((index, final(x)))
        del x  # what the loss saved of the last stage's output (logits) stays, the rest is freed, as in the strategy
        if index == 1:
            repeat.after_forward(tracker, counts, saved)

    def backward() -> None:
        index, output = pending.pop(0)
        if index not in simulated:
            repeat.backward(counts)
            return
        if index == 1:
            repeat.before(tracker, counts, saved)
        if work.last:
            with loss_parallel() if work.loss_parallel else nullcontext():
                output.backward()
        else:  # the gradient comes from the next device
            output.backward(grad_buffers[index] if grad_buffers else torch.empty_like(output))
        if index == 1:
            repeat.after_backward(counts)

    # A pipeline schedule keeps a sharded stage's gradients unreduced, and its parameters gathered, through every
    # micro-batch's backward (torch's backward_maybe_with_nosync), then reduces them once (perform_reduce_grad).
    sharded = [stage for stage in work.stages if isinstance(stage, FSDPModule)] if work.forward_in_backward else []
    for stage in sharded:
        stage.set_is_last_backward(False)
        stage.set_reshard_after_backward(False)
        stage.set_requires_gradient_sync(False)
    for index in range(min(work.in_flight, work.microbatches)):
        forward(index)
    activations = sum(saved.values())
    if not work.forward_in_backward:
        zero_grad()
    for index in range(work.in_flight, work.microbatches):
        backward()
        forward(index)
    while pending:
        backward()
    for stage in sharded:  # torch's own method, which reads only the stage's submodule
        _PipelineStageBase.perform_reduce_grad(SimpleNamespace(submod=stage), grad_scale_factor=1)  # type: ignore[arg-type]
    return activations


def simulated_microbatches(microbatches: int, in_flight: int) -> set[int]:
    """The micro-batches of a device's step that its simulation runs; the others are replayed.

    A step's micro-batches are alike: each forward leaves the same bytes held (what autograd saves) and counts the
    same FLOPs and collectives, and each backward frees what its forward left. What differs is the moment: how many
    micro-batches are in flight, whether the gradients exist yet. So the simulation runs the first (the stage's
    first gathers and gradients), the second (what the others repeat: the first may differ), and the two at the
    fullest moments: the last forward (the gradients made, all but one in flight) and the backward after it (all in
    flight). The
    others are replayed: a forward holds a tensor of the bytes the second left and counts its FLOPs and
    collectives; a backward frees it and counts the second's. Checked against every micro-batch simulated
    (``tests/test_plan_shortcuts.py``: exact, but the host's ops, whose bookkeeping differs by a few a micro-batch).
    A 1F1B rank of 8 stages at 16 micro-batches runs 4 of them, not 16."""
    return {0, 1, microbatches - in_flight, microbatches - 1} & set(range(microbatches))


class _Repeat:
    """What a simulated micro-batch (the second) held and counted, and its replay for the others."""

    def __init__(self) -> None:
        self.held = self.saved = 0
        self.forward_counts = _Tally()
        self.backward_counts = _Tally()
        self._start: tuple[int, _Tally, set[int]] = (0, _Tally(), set())

    def before(self, tracker: MemTracker, counts: StepCounts, saved: dict[Any, int]) -> None:
        self._start = (held_bytes(tracker), _Tally.of(counts), set(saved))

    def after_forward(self, tracker: MemTracker, counts: StepCounts, saved: dict[Any, int]) -> None:
        held, start, seen = self._start
        self.held = held_bytes(tracker) - held
        self.saved = sum(size for storage, size in saved.items() if storage not in seen)
        self.forward_counts = _Tally.of(counts).minus(start)

    def after_backward(self, counts: StepCounts) -> None:
        self.backward_counts = _Tally.of(counts).minus(self._start[1])

    def forward(
        self,
        index: int,
        pending: list[tuple[int, torch.Tensor]],
        saved: dict[Any, int],
        counts: StepCounts,
    ) -> None:
        pending.append((index, torch.empty(self.held, dtype=torch.uint8)))
        counts.host_ops["eager"] -= 1  # the stand-in's allocation: the replay's, not an op of the step
        saved[("replayed", index)] = self.saved
        self.forward_counts.add_to(counts)

    def backward(self, counts: StepCounts) -> None:
        self.backward_counts.add_to(counts)


@dataclass
class _Tally:
    """What a ``StepCounts`` has counted, as one counter: a snapshot, the difference of two, and a replay."""

    counted: Counter[str] = field(default_factory=Counter)

    SCALARS = ("flops", "recomputed_flops", "moved_bytes")
    COUNTERS = ("kernels", "collectives", "collective_calls", "host_ops")

    @classmethod
    def of(cls, counts: StepCounts) -> "_Tally":
        counted: Counter[str] = Counter({name: getattr(counts, name) for name in cls.SCALARS})
        for name in cls.COUNTERS:
            counted.update({f"{name}/{key}": value for key, value in getattr(counts, name).items()})
        return cls(counted)

    def minus(self, start: "_Tally") -> "_Tally":
        return _Tally(self.counted - start.counted)

    def device_plan(self, name: str, sizes: dict[str, int]) -> DevicePlan:
        """What was counted, as a device's plan of the model state ``sizes`` (its bytes in flight not known)."""

        def counter(kind: str) -> dict[str, int]:
            return {key[len(kind) + 1 :]: value for key, value in self.counted.items() if key.startswith(f"{kind}/")}

        return DevicePlan(
            name,
            sizes["params"],
            sizes["grads"],
            sizes["optimizer"],
            0,
            0,
            0,
            flops=self.counted["flops"],
            recomputed_flops=self.counted["recomputed_flops"],
            moved_bytes=self.counted["moved_bytes"],
            kernels=counter("kernels"),
            collectives=counter("collectives"),
            collective_calls=counter("collective_calls"),
            host_ops=counter("host_ops"),
        )

    def add_to(self, counts: StepCounts) -> None:
        for key, value in self.counted.items():
            name, _, item = key.partition("/")
            if item:
                getattr(counts, name)[item] += value
            else:
                setattr(counts, name, getattr(counts, name) + value)
