"""A deep model's plan from shallow copies of it: what ``plan=search`` simulates, so that dozens of layouts of a
70-block model take seconds each rather than minutes.

A transformer's blocks are all alike, and a simulation's cost is its ops, so it grows with the blocks a device
runs. Every figure of a device's plan is a line in those blocks: each block adds the same parameters, gradients,
optimizer state, saved activations, FLOPs and collective bytes (FSDP shards each block alike; a tensor-parallel
plan splits each alike), and the stem, the head and a pipeline's sends add a constant. So the same layout is
simulated with 3, 4 and 5 blocks per stage and each figure extended along its line to the device's real blocks.

The peak is a maximum over the step of such lines. If the step's fullest moment moved between the three depths,
the points are not on one line: then there is no extrapolation (the caller simulates in full). A move beyond the
third depth would go unseen, so ``plan=search`` simulates the layout it names in full before naming it.
"""

from dataclasses import fields

from project.job.job import Job
from project.plan.memory_plan import MemoryPlan, plan_memory
from project.plan.simulate import DevicePlan

DEPTHS = (3, 4, 5)  # blocks per stage of the shallow copies: from 3, FSDP's prefetching and checkpointing
# buffers have stopped growing (at 1 block there is no next block to prefetch)
LINEAR = [f.name for f in fields(DevicePlan) if f.type in (int, "int")]  # params, grads, ..., peak, flops
LINEAR_BY_KEY = [f.name for f in fields(DevicePlan) if str(f.type).startswith("dict")]  # kernels, collectives...


def blocks_per_device(job: Job) -> list[int]:
    """Blocks each device of the job's plan runs (``Layout.blocks_per_device``: a pipeline rank's stages; the
    devices of a layout without stages run every block)."""
    return job.layout.blocks_per_device(job.meta_net())


def shallow_copy(job: Job, depth: int) -> Job:
    """``job`` with ``depth`` blocks per stage (each stage of a pipeline or model-parallel split, else the net)."""
    return job.layout.at_depth(job, depth)


def extrapolated_plan(job: Job) -> MemoryPlan | None:
    """``job``'s memory plan (no suggestion) from its shallow copies, or None where that cannot be: a net without
    ``num_layers`` (blocks not all alike), a task that generates inside its steps, a device with too few blocks to
    gain from it (no more than the copies' together), or figures that are not on a line."""
    if job.model.num_layers is None or job.generation is not None:
        return None
    blocks = blocks_per_device(job)
    stages = blocks_per_device(shallow_copy(job, 1))  # the stages each device runs: its blocks at one a stage
    if any(full <= sum(DEPTHS) * count for full, count in zip(blocks, stages)):
        return None  # simulating it whole runs fewer blocks
    shallow = [plan_memory(shallow_copy(job, depth), suggest=False) for depth in DEPTHS]
    devices = []
    for index, full in enumerate(blocks):
        device = _extend([plan.devices[index] for plan in shallow], full / stages[index])
        if device is None:
            return None
        devices.append(device)
    first = shallow[0]
    return MemoryPlan(devices, first.capacity, first.capacity_source, first.activation_checkpointing, first.world_size)


def _extend(points: list[DevicePlan], depth: float) -> DevicePlan | None:
    """The device at ``depth`` blocks per stage from its plans at ``DEPTHS``, or None if a figure is off the line."""

    def along(values: list[int]) -> int | None:
        step = values[1] - values[0]
        if values[2] - values[1] != step:
            return None
        return round(values[0] + step * (depth - DEPTHS[0]))

    figures: dict = {name: along([getattr(point, name) for point in points]) for name in LINEAR}
    for name in LINEAR_BY_KEY:
        keys = sorted(set().union(*(getattr(point, name) for point in points)))
        figures[name] = {key: along([getattr(point, name).get(key, 0) for point in points]) for key in keys}
        if None in figures[name].values():
            return None
    if None in figures.values():
        return None
    return DevicePlan(name=points[0].name, **figures)
