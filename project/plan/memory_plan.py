"""Will it fit? The memory each device of a job needs, found before launch by simulating one step of each distinct
device on fake tensors (``project.plan.simulate``), at any world size, in this one process; and if it does not fit,
the smallest change that does.

How: the model is built on the meta device and the job's layout lays it out for a simulated rank as it would for a
real one (``Layout.simulated_devices``: FSDP shards it over a mesh of the job's world size on torch's fake
process-group backend, a pipeline keeps one rank's stages, ...); each such device's step is simulated.

A job on GPUs is simulated with CUDA's kernels (``project.plan.cuda_kernels``: CUDA's autocast, attention and
RMSNorm kernels, the allocator's blocks), any other with the CPU's; a compiled block as inductor partitions it
(``project.plan.compiled_blocks``). What a plan does not see: the caching allocator's fragmentation and CUDA's own
context (a GPU's real peak is higher than its allocated bytes), and the buffers inside a compiled kernel.
"""

import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from project.accounting.memory_trackers import MB
from project.config.build import overrides, with_strategy
from project.job.job import Change, Job, Setting
from project.job.rules import layout_problem
from project.layouts.fsdp_layout import FSDPLayout
from project.options.errors import ConfigError
from project.parallel.parallelize import Checkpointing
from project.plan.simulate import DevicePlan, GenerationPlan, generation_flops, simulate, simulate_generation

log = logging.getLogger(__name__)

GB = 2**30
PLAN_FILE = "memory_plan.json"  # in the job dir: the plan the run was launched with (DeviceMemory logs it)


@dataclass
class MemoryPlan:
    devices: list[DevicePlan]
    capacity: int  # bytes of one device
    capacity_source: str
    activation_checkpointing: Checkpointing
    world_size: int
    seconds: float = 0.0
    suggestion: str | None = None
    suggested_as: str = "Smallest change that fits"  # what the suggestion is: the first change tried that fits, or
    # plan=search's fastest layout
    alternatives: dict[str, int] = field(default_factory=dict)  # a tried change -> its peak
    partial: bool = False  # simulated only up to the first moment a device held more than the capacity
    # (plan=search): the rest of that device's step and the devices after it left out, so the peak is at least
    # ``peak``, and the step's FLOPs and collectives are not known

    generation: GenerationPlan | None = None  # what the task draws inside each step (GRPO's completions)

    @property
    def peak(self) -> int:
        """The most a device holds: in the step's forward and backward, or while it generates."""
        generating = self.generation.peak if self.generation is not None else 0
        return max(generating, *(device.peak for device in self.devices))

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def fullest(self) -> DevicePlan:
        return max(self.devices, key=lambda device: device.peak)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "peak": self.peak, "fits": self.fits}


def simulate_devices(
    job: Job, stop_above: int | None = None, progress: str | None = None
) -> tuple[list[DevicePlan], bool]:
    """Each distinct device of the job (``Layout.simulated_devices``) simulated, in order; with ``stop_above``, only
    up to the first moment a device holds more (``simulate``). Returns the devices, and whether the simulation
    stopped there. With ``progress``, a bar of that title counts the devices simulated and the time taken."""
    world_dim = job.dims.world_dim
    devices: list[DevicePlan] = []
    works = job.layout.simulated_devices(job)
    bar = tqdm(desc=progress, unit="device", leave=False, disable=progress is None, file=sys.stderr)
    for work in works:
        devices.append(simulate(work, job, world_dim, stop_above))
        bar.update()
        if stop_above is not None and devices[-1].peak > stop_above:
            works.close()
            bar.close()
            return devices, True
    bar.close()
    return devices, False


def simulate_job_generation(job: Job) -> GenerationPlan | None:
    """The generation inside each of the job's steps (``Job.generation``), simulated on its first device (a task
    that generates runs on data-parallel layouts, whose devices are alike), or None: it generates nothing."""
    if job.generation is None:
        return None
    works = job.layout.simulated_devices(job)
    generation = simulate_generation(next(iter(works)), job, job.dims.world_dim)
    works.close()
    return generation


def device_capacity(job: Job) -> tuple[int, str]:
    """Bytes of one device, and where the figure comes from: ``memory_plan.device_memory_gb`` if set, else the
    ``cluster``'s GPU's, else the GPU's, else on a CPU this machine's memory shared by the node's devices."""
    if job.device_memory_gb is not None:
        return int(job.device_memory_gb * GB), "memory_plan.device_memory_gb"
    if job.cluster is not None:
        return int(job.cluster.memory_gb * GB), f"cluster={job.cluster.name}"
    if job.uses_cuda and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)  # no CUDA context is opened for this
        return properties.total_memory, properties.name
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // job.devices, f"this machine's {total / GB:.0f} GiB over {job.devices} device(s)"


def candidate_changes(job: Job) -> Iterator[tuple[str, Job]]:
    """Changes that lower the memory per device, the smallest first, each as the overrides a user would type and
    the job they make: activation checkpointing; the layout's own (``Layout.memory_saving_changes``: a pipeline's
    more micro-batches or stages); FSDP over the same devices; a smaller batch per step with the same global batch;
    FSDP over more devices, then more nodes, up to 1024 ranks. (Not tensor parallelism: at the same global batch it
    holds what FSDP over the same devices holds, and torch's sequence parallelism more.) Selective checkpointing
    comes before full: it recomputes less."""

    for change in _memory_saving_changes(job):
        yield overrides(change.job, change.sets), change.job


def _memory_saving_changes(job: Job) -> Iterator[Change]:
    checkpointing = frozenset({Setting.ACTIVATION_CHECKPOINTING})
    if job.activation_checkpointing == "off":
        yield Change(with_checkpointing(job, "selective"), checkpointing)
    full = job.activation_checkpointing != "full"
    if full:
        yield Change(with_checkpointing(job, "full"), checkpointing)
    yield from job.layout.memory_saving_changes(job)
    devices, nodes = job.devices, job.nodes
    fsdp = with_strategy(job, "fsdp")
    if not isinstance(job.layout, FSDPLayout) and devices * nodes > 1:
        yield Change(fsdp, frozenset({Setting.STRATEGY}))
        if full:
            yield Change(with_checkpointing(fsdp, "full"), frozenset({Setting.STRATEGY, *checkpointing}))
    batch, accumulate = job.batch_size, job.accumulate
    while batch > 1:
        batch, accumulate = batch // 2, accumulate * 2
        yield Change(
            replace(job, batch_size=batch, accumulate=accumulate), frozenset({Setting.BATCH_SIZE, Setting.ACCUMULATE})
        )
    while devices * nodes < 1024:
        if nodes == 1 and devices < 8:
            devices *= 2
        else:
            nodes *= 2
        yield Change(
            replace(fsdp, devices=devices, nodes=nodes), frozenset({Setting.STRATEGY, Setting.DEVICES, Setting.NODES})
        )


def with_checkpointing(job: Job, mode: Checkpointing) -> Job:
    """``job`` with the model's activation checkpointing ``mode`` (``model.activation_checkpointing``)."""
    return replace(job, model=replace(job.model, activation_checkpointing=mode))


def checkpointing_switched(job: Job) -> Job:
    """``job`` with activation checkpointing the other way (off: full; full or selective: off), the model's and
    the layout's own (FSDP's) too."""
    mode: Checkpointing = "full" if job.activation_checkpointing == "off" else "off"
    return replace(with_checkpointing(job, mode), layout=job.layout.with_activation_checkpointing(mode))


def checkpointing_label(mode: Checkpointing) -> str:
    """How the plan's header and columns name a mode: full checkpointing is "on"."""
    return {"off": "off", "full": "on", "selective": "selective"}[mode]


def plan_memory(
    job: Job,
    suggest: bool = True,
    alternatives: bool = False,
    stop_over_capacity: bool = False,
    progress: bool = False,
) -> MemoryPlan:
    """The job's memory plan: every distinct device simulated (with ``stop_over_capacity``, up to the first moment
    one holds more than the capacity: the plan is then ``partial``); if it does not fit and ``suggest``, the first of
    ``candidate_changes`` that can run and fits; with ``alternatives``, each device's figures with activation
    checkpointing switched the other way too. With ``progress``, a bar for each of those simulations."""
    start = time.perf_counter()
    capacity, source = device_capacity(job)
    title = (lambda what: f"Simulating {what}") if progress else (lambda what: None)
    devices, partial = simulate_devices(job, capacity if stop_over_capacity else None, title("the config's layout"))
    plan = MemoryPlan(devices, capacity, source, job.activation_checkpointing, job.world_size, partial=partial)
    plan.generation = None if partial else simulate_job_generation(job)
    if alternatives:
        switched = checkpointing_switched(job)
        described = title(f"it with activation checkpointing {checkpointing_label(switched.activation_checkpointing)}")
        for device, other in zip(plan.devices, simulate_devices(switched, progress=described)[0]):
            device.activations_checkpointed, device.peak_checkpointed = other.activations, other.peak
    if suggest and not plan.fits:
        for change, changed in candidate_changes(job):
            if layout_problem(changed) is not None:
                continue
            generation = simulate_job_generation(changed)
            peak = max(device.peak for device in simulate_devices(changed, progress=title(change))[0])
            peak = max(peak, generation.peak if generation is not None else 0)
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


def format_plan(plan: MemoryPlan, job: Job) -> str:
    """The plan as a table, one row per distinct device, and the verdict."""
    header = (
        f"Memory plan: model={job.model.name} strategy={job.strategy_name}, "
        f"{job.devices} device(s) x {job.nodes} node(s) = {plan.world_size} process(es), "
        f"precision {job.precision}, data.batch_size={job.batch_size}, activation checkpointing "
        f"{checkpointing_label(plan.activation_checkpointing)} (simulated in {plan.seconds:.1f} s)"
    )
    other = "on" if plan.activation_checkpointing == "off" else "off"
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
    if plan.generation is not None and job.generation is not None:
        generation, drawn = plan.generation, job.generation
        lines.append(
            f"Generating inside each step ({generation.prompts} prompt(s) x {drawn.sequences} completions of up to "
            f"{drawn.new_tokens} tokens, after a prompt of up to {drawn.prompt_tokens}): peak "
            f"{_size(generation.peak)}, of which the key/value cache {_size(generation.cache)} and the model "
            f"gathered {_size(generation.gathered)}; {generation_flops(generation) / 1e12:.3g} TFLOP."
        )
    kept = max(device.kept for device in plan.devices)
    if kept:
        lines.append(
            f"Kept beside the model state: {_size(kept)} a device, the task's copy of its initial weights (GRPO's "
            "reference with full weights, model.grpo.beta > 0)."
        )
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


def check_fits(plan: MemoryPlan, job: Job) -> None:
    """Refuse a run predicted not to fit (``ConfigError`` naming the change that fits), or with
    ``memory_plan.if_over=warn`` warn and go on."""
    if plan.fits:
        return
    fix = f"change {plan.suggestion}, or " if plan.suggestion else "use more devices or a smaller model or batch, or "
    problem = (
        f"predicts a peak of {_size(plan.peak)} on {plan.fullest().name}, more than the "
        f"{_size(plan.capacity)} of a device ({plan.capacity_source})."
    )
    if job.if_over == "warn":
        log.warning(f"The memory plan {problem} Training anyway (memory_plan.if_over=warn).")
        return
    raise ConfigError(
        "memory_plan",
        problem,
        fix + "set memory_plan.if_over=warn to train anyway (python train.py ... plan=true prints the plan).",
    )


def write_plan(plan: MemoryPlan, job_dir: Path) -> None:
    (job_dir / PLAN_FILE).write_text(json.dumps(plan.to_json(), indent=1))
