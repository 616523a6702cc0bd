"""Will it fit? The memory each device of a job needs, found before launch by simulating one device's training
steps on fake tensors, at any world size, in this one process.

How: the model is built on the meta device and each strategy lays it out for a simulated rank as it would for a
real one (``simulated_devices`` on the strategy class: FSDP shards it over a mesh of the job's world size on
torch's fake process-group backend, a pipeline keeps one rank's stages, ...). The rank's parameters are then
allocated as fake tensors (shapes and dtypes, no memory), the optimizer makes its state, and a training step runs
on them under PyTorch's ``MemTracker``, in Lightning's order (forward, zero_grad, backward, optimizer step), at the
configured batch, sequence length and precision. The tracker follows every tensor's storage as it is made and
freed: its peak is the plan's peak; parameters, gradients and optimizer state are counted from the rank's tensors
after the step, as ``project.memory.DeviceMemory`` counts a real run's.

What a plan does not see: the caching allocator's fragmentation and CUDA's own context (a GPU's real peak is
higher than its allocated bytes), kernels of another device (the simulation runs the CPU's: its attention keeps
the score matrix a GPU's flash attention would not), and ``torch.compile``'s fused kernels.
"""

import functools
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Generator, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import torch
from hydra.utils import instantiate
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.distributed.tensor import DTensor, _sharding_prop
from torch.distributed.tensor.parallel import loss_parallel

from project.config.build import build_net, build_strategy, parallel_dims
from project.config.checks import check_config, strategy_class, uses_cuda
from project.config.errors import ConfigError
from project.distributed.dims import DATA_PARALLEL
from project.distributed.parallelize import allocate, apply_activation_checkpointing
from project.distributed.strategies import FSDPStrategy
from project.memory.counts import Link, StepCounts
from project.memory.measure import (
    MB,
    OverCapacity,
    StepFSDPMemTracker,
    StepMemoryTracker,
    held_bytes,
    model_state_bytes_per_device,
)
from project.memory.simulation import DeviceWork, TaskModule

log = logging.getLogger(__name__)

GB = 2**30
# What FSDPMemTracker counts as FSDP's communication: gathered parameters and the buffers of the collectives.
FSDP_COMMUNICATION = (_FSDPRefType.UNSHARDED_PARAM, _FSDPRefType.ALL_GATHER, _FSDPRefType.REDUCE_SCATTER)
# The compute dtype of Lightning's mixed precisions (autocast): on the CPU's kernels in the simulation.
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
PLAN_FILE = "memory_plan.json"  # in the job dir: the plan the run was launched with (DeviceMemory logs it)


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
    flops: int = 0  # floating-point operations of the step on this device (project.memory.counts)...
    recomputed_flops: int = 0  # ...of which activation checkpointing's recompute
    collectives: dict[str, int] = field(default_factory=dict)  # bytes of the step's collectives, by Link key

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer


@dataclass
class MemoryPlan:
    devices: list[DevicePlan]
    capacity: int  # bytes of one device
    capacity_source: str
    activation_checkpointing: bool
    world_size: int
    seconds: float = 0.0
    suggestion: str | None = None
    suggested_as: str = "Smallest change that fits"  # what the suggestion is: the first change tried that fits, or
    # plan=search's fastest layout
    alternatives: dict[str, int] = field(default_factory=dict)  # a tried change -> its peak
    partial: bool = False  # simulated only up to the first moment a device held more than the capacity
    # (plan=search): the rest of that device's step and the devices after it left out, so the peak is at least
    # ``peak``, and the step's FLOPs and collectives are not known

    @property
    def peak(self) -> int:
        return max(device.peak for device in self.devices)

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def fullest(self) -> DevicePlan:
        return max(self.devices, key=lambda device: device.peak)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "peak": self.peak, "fits": self.fits}


def _precision(cfg: DictConfig) -> str:
    # None only for trainer.precision=null, which the config checks have met first.
    return cast(str, _convert_precision_to_unified_args(cfg.trainer.precision))


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(tensor.untyped_storage().nbytes() for tensor in tensors)


def simulate(work: DeviceWork, cfg: DictConfig, world_dim: str, stop_above: int | None = None) -> DevicePlan:
    """A training step of ``work`` on fake tensors under ``MemTracker``, the optimizer's state already made (so,
    a second step, which holds the most): the device's bytes, FLOPs and collectives (``world_dim``: the mesh
    dimension of the collectives over every rank, ``ParallelDims.world_dim``). With ``stop_above``, the step stops
    at the first moment the device holds more: its peak is then just above it, and its activations, FLOPs and
    collectives those counted up to there."""
    precision = _precision(cfg)
    module, net = work.module, work.module.net
    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode:
        allocate(net, torch.device("cpu"))
        if precision in ("bf16-true", "16-true"):  # Lightning's HalfPrecision converts the module
            net.to(torch.bfloat16 if precision == "bf16-true" else torch.float16)
        optimizer = module.optimizer_factory(params=module._optimizer_groups())
        # As after a first step: the optimizer's state (a step on zero gradients makes it, without a forward) and
        # the gradients, which Lightning frees only after the next forward.
        for parameter in net.parameters():
            parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
        tracker: MemTracker
        if isinstance(net, FSDPModule):  # the same counts, and which of them are FSDP's gathers and reductions
            tracker = StepFSDPMemTracker(net, optimizer)
        else:
            tracker = StepMemoryTracker()
            tracker.track_external(net, optimizer)
        tracker.stop_above = stop_above
        saved: dict[Any, int] = {}  # storage -> bytes, of the tensors saved for backward that are not parameters
        held: list[torch.Tensor] = []  # for the whole run: communication buffers
        input_buffers: list[torch.Tensor] = []
        grad_buffers: list[torch.Tensor] = []
        # Counted: the forward and backward (what a run's training_step and backward run); not the optimizer's
        # step, whose only collectives are a few small all-reduces of tensor-parallel norms' gradients.
        counts = StepCounts(cfg.trainer.devices, world_dim, fake_mode)
        activations: int | None = None
        with tracker, _dtensor_shapes_inferred_apart():
            try:
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
                batches = [
                    module.example_batch(cfg.data.batch_size, cfg.data) for _ in range(1 if uses_cuda(cfg) else 2)
                ]
                microbatch = tuple(tensor[: work.microbatch_size] for tensor in batches[0])
                with counts:
                    activations = _step(
                        work, module, optimizer, microbatch, input_buffers, grad_buffers, tracker, counts, cfg, saved
                    )
                optimizer.step()
            except OverCapacity:  # it does not fit, whatever the rest of the step holds
                pass
            comm_bytes = _storage_bytes(held + input_buffers + grad_buffers)
            if work.grads_persist:
                comm_bytes += sum(_storage_bytes([p.grad]) for p in net.parameters() if p.grad is not None)
        if activations is None:  # stopped within the step: what was saved up to there
            activations = sum(saved.values())
        sizes = model_state_bytes_per_device(net, [optimizer]).get(0, {"params": 0, "grads": 0, "optimizer": 0})
        at_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        peak = held_bytes(tracker, "peak")
        comm_bytes += sum(at_peak.get(kind, 0) for kind in FSDP_COMMUNICATION)
    # What the simulation does not run: DDP's all-reduce of the gradients (no DDP wrapper), a pipeline's sends.
    counted = counts.collectives + Counter(work.unsimulated_collectives)
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
        collectives={kind: counted[kind] for kind in sorted(counted) if counted[kind]},
    )


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
    cfg: DictConfig,
    saved: dict[Any, int],
) -> int:
    """A training step in Lightning's order up to the optimizer's step (the caller's): forward
    (``training_step``), ``zero_grad``, backward; a pipeline's forwards run inside its backward, after
    ``zero_grad``, in its schedule's order, its micro-batches outside ``simulated_microbatches`` replayed.
    Returns the bytes autograd saved for backward in the forwards in flight at once (each storage once,
    parameters and views of them not counted); ``saved`` gathers them, storage by storage."""
    data_inputs, target = batch
    autocast_dtype = AUTOCAST_DTYPES.get(_precision(cfg))
    autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
    # With gradient accumulation, the step that holds the most is a later one of the accumulation: Lightning does
    # not zero the gradients there, so the previous batches' are held through the forward and backward.
    accumulating = cfg.trainer.accumulate_grad_batches > 1
    zero_grad = lambda: accumulating or optimizer.zero_grad(set_to_none=not work.grads_persist)  # noqa: E731
    if work.forward_in_backward:
        zero_grad()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, nn.Parameter) and not isinstance(tensor._base, nn.Parameter):  # a linear saves W.T
            # A tensor-parallel activation is a DTensor: its bytes are this rank's part (its local tensor).
            storage = (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).untyped_storage()
            saved[storage._cdata] = storage.nbytes()
        return tensor

    pending: list[tuple[int, torch.Tensor]] = []  # micro-batches whose backward is still to run, oldest first
    kept: list[torch.Tensor] = []
    simulated = simulated_microbatches(work.microbatches, min(work.in_flight, work.microbatches))
    repeat = _Repeat()  # micro-batch 1's effects, which a replayed micro-batch repeats

    def forward(index: int) -> None:
        if index not in simulated:
            repeat.forward(index, pending, kept, saved, counts)
            return
        if index == 1:
            repeat.before(tracker, counts, saved)
        if work.stage_input is None:
            x = data_inputs
        elif input_buffers:
            x = input_buffers[index].detach().requires_grad_()
        else:  # arrives from the previous device
            x = torch.empty_like(work.stage_input, device="cpu").requires_grad_()
        with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            for stage in work.stages:
                x = stage(x)
            if work.keeps_outputs:
                kept.append(x.detach())
            pending.append((index, module.criterion(x, target) / work.microbatches if work.last else x))
        if index == 1:
            repeat.after_forward(tracker, counts, saved, kept[-1] if work.keeps_outputs else None)

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
    if kept:
        merged = torch.cat(kept)  # the schedule merges the micro-batches' outputs for the metrics
        del merged, kept[:]
    return activations


def simulated_microbatches(microbatches: int, in_flight: int) -> set[int]:
    """The micro-batches of a device's step that its simulation runs; the others are replayed.

    A step's micro-batches are alike: each forward leaves the same bytes held (what autograd saves, and a last
    stage's output kept for the metrics) and counts the same FLOPs and collectives, and each backward frees what its
    forward left. What differs is the moment: how many micro-batches are in flight, whether the gradients exist yet,
    how many outputs are kept. So the simulation runs the first (the stage's first gathers and gradients), the
    second (what the others repeat: the first may differ), and the two at the fullest moments: the last forward (the
    most outputs kept, the gradients made, all but one in flight) and the backward after it (all in flight). The
    others are replayed: a forward holds a tensor of the bytes the second left and counts its FLOPs and
    collectives; a backward frees it and counts the second's. Checked against every micro-batch simulated
    (``tests/test_plan_shortcuts.py``). A 1F1B rank of 8 stages at 16 micro-batches runs 4 of them, not 16."""
    return {0, 1, microbatches - in_flight, microbatches - 1} & set(range(microbatches))


class _Repeat:
    """What a simulated micro-batch (the second) held and counted, and its replay for the others."""

    def __init__(self) -> None:
        self.held = self.kept = self.saved = self.flops = self.backward_flops = self.backward_recomputed_flops = 0
        self.collectives: Counter[str] = Counter()
        self.backward_collectives: Counter[str] = Counter()
        self.kept_like: torch.Tensor | None = None
        self._start: tuple[int, int, Counter[str], set[int]] = (0, 0, Counter(), set())
        self._recomputed_start = 0

    def before(self, tracker: MemTracker, counts: StepCounts, saved: dict[Any, int]) -> None:
        self._start = (held_bytes(tracker), counts.flops, Counter(counts.collectives), set(saved))
        self._recomputed_start = counts.recomputed_flops

    def after_forward(
        self, tracker: MemTracker, counts: StepCounts, saved: dict[Any, int], kept: torch.Tensor | None
    ) -> None:
        held, flops, collectives, seen = self._start
        self.kept_like = kept
        self.kept = kept.untyped_storage().nbytes() if kept is not None else 0
        self.held = held_bytes(tracker) - held - self.kept
        self.saved = sum(size for storage, size in saved.items() if storage not in seen)
        self.flops, self.collectives = counts.flops - flops, counts.collectives - collectives

    def after_backward(self, counts: StepCounts) -> None:
        _, flops, collectives, _ = self._start
        self.backward_flops = counts.flops - flops
        self.backward_recomputed_flops = counts.recomputed_flops - self._recomputed_start
        self.backward_collectives = counts.collectives - collectives

    def forward(
        self,
        index: int,
        pending: list[tuple[int, torch.Tensor]],
        kept: list[torch.Tensor],
        saved: dict[Any, int],
        counts: StepCounts,
    ) -> None:
        pending.append((index, torch.empty(self.held, dtype=torch.uint8)))
        if self.kept_like is not None:
            kept.append(torch.empty_like(self.kept_like))
        saved[("replayed", index)] = self.saved
        counts.flops += self.flops
        counts.collectives.update(self.collectives)

    def backward(self, counts: StepCounts) -> None:
        counts.flops += self.backward_flops
        counts.recomputed_flops += self.backward_recomputed_flops
        counts.collectives.update(self.backward_collectives)


def _new_module_factory(cfg: DictConfig):
    """Builds the job's LightningModule around a fresh meta-device net, with the model's own activation
    checkpointing applied as ``configure_model`` applies it (each simulated device cuts or shards its own)."""

    def new_module() -> TaskModule:
        module = instantiate(cfg.model, net=build_net(cfg))
        if module.activation_checkpointing:
            apply_activation_checkpointing(module.net)
        return module

    return new_module


def whole_model_devices(cfg: DictConfig, new_module) -> Iterator[DeviceWork]:
    """One device with the whole model: one device alone, or any rank of DDP (each a replica). DDP's gradients
    live in its all-reduce buckets for the whole run: as views of them (``gradient_as_bucket_view``), or beside
    them, in buckets of the gradients' size."""
    module = new_module()
    cls = strategy_class(cfg)  # None: auto, which Lightning makes DDP over several devices
    world = cfg.strategy.processes * cfg.trainer.num_nodes
    ddp = (cls is None or issubclass(cls, DDPStrategy)) and world > 1
    views = ddp and bool(OmegaConf.select(cfg, "strategy.gradient_as_bucket_view"))  # DDP's own default: false
    gradients = sum(p.numel() * p.element_size() for p in module.net.parameters() if p.requires_grad)
    yield DeviceWork(
        "rank 0",
        module,
        [module.net],
        cfg.data.batch_size,
        grads_persist=views,
        extra_buffer_bytes=gradients if ddp and not views else 0,
        # Every gradient, once a step, over all the job's ranks, node by node.
        unsimulated_collectives={Link("all_reduce", DATA_PARALLEL, world, cfg.trainer.num_nodes).key: gradients}
        if ddp
        else {},
    )


def device_works(cfg: DictConfig) -> Generator[DeviceWork, None, None]:
    """The devices of the job whose memory differs, each as its strategy lays it out (``simulated_devices`` on the
    strategy class); auto and DDP keep the whole model on each."""
    simulated = getattr(strategy_class(cfg), "simulated_devices", None)
    yield from (simulated or whole_model_devices)(cfg, _new_module_factory(cfg))


def simulate_devices(cfg: DictConfig, stop_above: int | None = None) -> tuple[list[DevicePlan], bool]:
    """Each distinct device of the job simulated, in order; with ``stop_above``, only up to the first moment a
    device holds more (``simulate``). Returns the devices, and whether the simulation stopped there."""
    world = cfg.strategy.processes * cfg.trainer.num_nodes
    world_dim = parallel_dims(build_strategy(cfg.strategy), world).world_dim
    devices: list[DevicePlan] = []
    works = device_works(cfg)
    for work in works:
        devices.append(simulate(work, cfg, world_dim, stop_above))
        if stop_above is not None and devices[-1].peak > stop_above:
            works.close()
            return devices, True
    return devices, False


def device_capacity(cfg: DictConfig) -> tuple[int, str]:
    """Bytes of one device, and where the figure comes from: ``memory_plan.device_memory_gb`` if set, else the
    ``cluster``'s GPU's, else the GPU's, else on a CPU this machine's memory shared by the node's devices."""
    gigabytes = cfg.memory_plan.device_memory_gb
    if gigabytes is not None:
        return int(gigabytes * GB), "memory_plan.device_memory_gb"
    if cfg.get("cluster") is not None:
        return int(cfg.cluster.memory_gb * GB), f"cluster={cfg.cluster.name}"
    if uses_cuda(cfg) and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)  # no CUDA context is opened for this
        return properties.total_memory, properties.name
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // cfg.trainer.devices, f"this machine's {total / GB:.0f} GiB over {cfg.trainer.devices} device(s)"


def _changed(cfg: DictConfig, changes: dict[str, Any], strategy: str | None = None) -> DictConfig:
    """``cfg`` (resolved) with ``strategy`` replaced by that option of the ``strategy`` group, as its file in
    ``conf/strategy`` sets it, and dotted keys set; resolved again."""
    container = cast(dict[str, Any], OmegaConf.to_container(cfg))  # a copy: cfg itself stays as it is
    if strategy is not None:
        container["strategy"] = _strategy_option(strategy)
    changed = OmegaConf.create(container)
    with open_dict(changed):
        for key, value in changes.items():
            OmegaConf.update(changed, key, value, force_add=True)
    OmegaConf.resolve(changed)  # in place: a search builds dozens of these, and each new DictConfig is costly
    return changed


@functools.cache
def _strategy_option(name: str) -> dict[str, Any]:
    """The ``strategy`` group's option ``name``, as its file in ``conf/strategy`` sets it (unresolved)."""
    path = Path(__file__).resolve().parents[2] / "conf" / "strategy" / f"{name}.yaml"
    return cast(dict[str, Any], OmegaConf.to_container(OmegaConf.load(path)))


def _checkpointing(cfg: DictConfig) -> bool:
    return bool(cfg.model.get("activation_checkpointing") or OmegaConf.select(cfg, "strategy.activation_checkpointing"))


def candidate_changes(cfg: DictConfig) -> Iterator[tuple[str, DictConfig]]:
    """Changes that lower the memory per device, the smallest first, each as the overrides a user would type and
    the config they make: activation checkpointing; the strategy's own (``memory_saving_changes`` on its class: a
    pipeline's more micro-batches or stages); FSDP over the same devices; a smaller batch per step with the same
    global batch; FSDP over more devices, then more nodes, up to 1024 ranks. (Not tensor parallelism: at the same
    global batch it holds what FSDP over the same devices holds, and torch's sequence parallelism more.)"""

    checkpointing = {} if _checkpointing(cfg) else {"model.activation_checkpointing": True}
    if checkpointing:
        yield "model.activation_checkpointing=true", _changed(cfg, checkpointing)
    cls = strategy_class(cfg)
    for change, changes in getattr(cls, "memory_saving_changes", lambda cfg: [])(cfg):
        yield change, _changed(cfg, changes)
    fsdp = cls is not None and issubclass(cls, FSDPStrategy)
    devices, nodes = cfg.trainer.devices, cfg.trainer.num_nodes
    if not fsdp and devices * nodes > 1:
        yield "strategy=fsdp", _changed(cfg, {}, "fsdp")
        if checkpointing:
            yield "strategy=fsdp model.activation_checkpointing=true", _changed(cfg, checkpointing, "fsdp")
    batch, accumulate = cfg.data.batch_size, cfg.trainer.accumulate_grad_batches
    while batch > 1:
        batch, accumulate = batch // 2, accumulate * 2
        yield (
            f"data.batch_size={batch} trainer.accumulate_grad_batches={accumulate}",
            _changed(cfg, {"data.batch_size": batch, "trainer.accumulate_grad_batches": accumulate}),
        )
    while devices * nodes < 1024:
        if nodes == 1 and devices < 8:
            devices *= 2
        else:
            nodes *= 2
        yield (
            f"strategy=fsdp trainer.devices={devices} trainer.num_nodes={nodes}",
            _changed(cfg, {"trainer.devices": devices, "trainer.num_nodes": nodes}, "fsdp"),
        )


def _valid(cfg: DictConfig) -> bool:
    """Whether ``cfg`` passes the checks of a run (a smaller batch must still split into micro-batches...)."""
    try:
        check_config(cfg)
    except ConfigError:
        return False
    return True


def plan_memory(
    cfg: DictConfig, suggest: bool = True, alternatives: bool = False, stop_over_capacity: bool = False
) -> MemoryPlan:
    """The job's memory plan: every distinct device simulated (with ``stop_over_capacity``, up to the first moment
    one holds more than the capacity: the plan is then ``partial``); if it does not fit and ``suggest``, the first of
    ``candidate_changes`` that fits; with ``alternatives``, each device's figures with activation checkpointing
    switched the other way too."""
    start = time.perf_counter()
    capacity, source = device_capacity(cfg)
    devices, partial = simulate_devices(cfg, capacity if stop_over_capacity else None)
    world = cfg.strategy.processes * cfg.trainer.num_nodes
    plan = MemoryPlan(devices, capacity, source, _checkpointing(cfg), world, partial=partial)
    if alternatives:
        switched = {"model.activation_checkpointing": not plan.activation_checkpointing}
        if OmegaConf.select(cfg, "strategy.activation_checkpointing") is not None:
            switched["strategy.activation_checkpointing"] = not plan.activation_checkpointing
        for device, other in zip(plan.devices, simulate_devices(_changed(cfg, switched))[0]):
            device.activations_checkpointed, device.peak_checkpointed = other.activations, other.peak
    if suggest and not plan.fits:
        for change, changed in candidate_changes(cfg):
            if not _valid(changed):
                continue
            peak = max(device.peak for device in simulate_devices(changed)[0])
            plan.alternatives[change] = peak
            if peak <= capacity:
                plan.suggestion = change
                break
    plan.seconds = time.perf_counter() - start
    return plan


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    if size >= GB:
        return f"{size / GB:.2f} GiB"
    return f"{size / MB:.1f} MiB" if size >= MB else f"{size / 2**10:.1f} KiB"


def format_plan(plan: MemoryPlan, cfg: DictConfig) -> str:
    """The plan as a table, one row per distinct device, and the verdict."""
    choices = cfg.get("choices") or {}
    header = (
        f"Memory plan: model={choices.get('model', '?')} strategy={choices.get('strategy', '?')}, "
        f"{cfg.trainer.devices} device(s) x {cfg.trainer.num_nodes} node(s) = {plan.world_size} process(es), "
        f"precision {_precision(cfg)}, data.batch_size={cfg.data.batch_size}, activation checkpointing "
        f"{'on' if plan.activation_checkpointing else 'off'} (simulated in {plan.seconds:.1f} s)"
    )
    other = "off" if plan.activation_checkpointing else "on"
    columns = ["device", "params", "grads", "optimizer", "activations", "comm buffers", "peak", "TFLOP", "comm/step"]
    with_alternative = any(device.peak_checkpointed is not None for device in plan.devices)
    if with_alternative:
        columns += [f"activations (AC {other})", f"peak (AC {other})"]
    rows = []
    for device in plan.devices:
        row = [device.name] + [
            _size(getattr(device, name))
            for name in ("params", "grads", "optimizer", "activations", "comm_buffers", "peak")
        ]
        row += [f"{device.flops / 1e12:.3g}", _size(sum(device.collectives.values()))]
        if with_alternative:
            row += [_size(device.activations_checkpointed), _size(device.peak_checkpointed)]
        rows.append(row)
    widths = [max(len(str(row[i])) for row in rows + [columns]) for i in range(len(columns))]
    lines = [header, "  ".join(name.rjust(width) for name, width in zip(columns, widths))]
    lines += ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"Peak {_size(plan.peak)} per device {verdict} in {_size(plan.capacity)} ({plan.capacity_source}).")
    for change, peak in plan.alternatives.items():
        lines.append(f"  tried {change}: peak {_size(peak)}")
    if not plan.fits:
        lines.append(
            f"{plan.suggested_as}: {plan.suggestion}"
            if plan.suggestion
            else "No change tried fits; more devices, a smaller model or a shorter sequence may."
        )
    return "\n".join(lines)


def check_fits(plan: MemoryPlan, cfg: DictConfig) -> None:
    """Refuse a run predicted not to fit (``ConfigError`` naming the change that fits), or with
    ``memory_plan.if_over=warn`` warn and go on."""
    if plan.fits:
        return
    fix = f"change {plan.suggestion}, or " if plan.suggestion else "use more devices or a smaller model or batch, or "
    problem = (
        f"predicts a peak of {_size(plan.peak)} on {plan.fullest().name}, more than the "
        f"{_size(plan.capacity)} of a device ({plan.capacity_source})."
    )
    if cfg.memory_plan.if_over == "warn":
        log.warning(f"The memory plan {problem} Training anyway (memory_plan.if_over=warn).")
        return
    raise ConfigError(
        "memory_plan",
        problem,
        fix + "set memory_plan.if_over=warn to train anyway (python train.py ... plan=true prints the plan).",
    )


def write_plan(plan: MemoryPlan, job_dir: Path) -> None:
    (job_dir / PLAN_FILE).write_text(json.dumps(plan.to_json(), indent=1))
