"""``strategy=pipeline``: one process per pipeline stage, micro-batches flowing through them
(torch.distributed.pipelining), the rest of the ranks data parallel, each stage's layers optionally split over
tensor-parallel ranks (3D).

The model's blocks are split into stages (``project.parallel.parallelize.split_blocks``); rank r of a pipeline keeps
only the blocks of its stages. A batch is cut into ``microbatches`` and a schedule (GPipe, 1F1B, interleaved 1F1B)
overlaps their forward and backward passes across the stages, so fewer devices sit idle than in ``model_parallel``:
the idle fraction (bubble) is (S - 1) / (M + S - 1) for S stages and M micro-batches. When there are more ranks than
one pipeline needs, the rest is data parallel: the ranks form a (pipeline x data_parallel x tensor_parallel) mesh
and each stage is sharded with FSDP over its data-parallel group; a mixture's experts can be split over groups of
``expert_parallel`` of those ranks, as under FSDP (``project.parallel.expert_parallel``).
"""

from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace
from itertools import product
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from project.accounting.counts import group_link
from project.checkpointing.files import is_sharded_checkpoint
from project.job.job import Change, Job, Setting
from project.job.layout import DeviceWork
from project.layouts.sharded_layout import ShardedLayout, expert_parallel_problem
from project.layouts.stage_split import stage_split_problem, staged_at_depth
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.parallel.dims import DATA_PARALLEL, EXPERT, EXPERT_SHARD, PIPELINE, ParallelDims, divisors
from project.parallel.expert_parallel import (
    apply_expert_parallel,
    expert_counts,
    expert_parallel_sizes,
)
from project.parallel.fake_process_group import fake_process_group
from project.parallel.parallelize import (
    apply_fsdp,
    block_inputs,
    block_sizes,
    fsdp_param_dtype,
    keep_only,
    split_blocks,
    stage_modules,
)

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b"]  # strategy.schedule's values, checked before launch


class StageModule(nn.Module):
    """The modules of one pipeline stage, run in order; shares the model's parameters. They are its ``blocks``,
    so ``apply_fsdp`` shards the stage module by module."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _in_flight(schedule: str, microbatches: int, ranks: int, rank: int, stages_per_rank: int) -> int:
    """Micro-batches whose activations pipeline rank ``rank`` holds at once under ``schedule``: GPipe runs every
    forward first; 1F1B starts with one per stage still ahead, then alternates; interleaved 1F1B's warm-up
    (torch's formula, in stage chunks) spread over the rank's stages."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, ranks - rank)
    chunks = (stages_per_rank - 1) * ranks + 2 * (ranks - 1 - rank) + 1
    return min(microbatches, -(-chunks // stages_per_rank))


@dataclass(frozen=True, kw_only=True)
class PipelineLayout(ShardedLayout):
    """``num_stages`` stages over ``num_stages / stages_per_rank`` ranks per pipeline, run under ``schedule`` with
    ``microbatches`` micro-batches a batch, of ``blocks_per_stage`` blocks each (None: balanced by parameters), each
    stage split over ``tensor_parallel.size`` ranks. The last stage's logits go through the schedule, which passes
    plain tensors: they are gathered, not split by vocabulary (``tensor_parallel.loss_parallel`` false)."""

    num_stages: int
    schedule: ScheduleName = "1f1b"
    microbatches: int = 4
    stages_per_rank: int = 1
    blocks_per_stage: tuple[int, ...] | None = None
    expert_parallel: int = 1  # data-parallel ranks that split a mixture's experts (strategy.expert_parallel_size)

    @property
    def pipeline_size(self) -> int:
        """Ranks one pipeline spans: its stages over the stages each rank runs."""
        return self.num_stages // self.stages_per_rank

    def stages_of(self, pipeline_rank: int) -> list[int]:
        """The stages pipeline rank r runs: r, r + P, r + 2P, ... (interleaved when several)."""
        return [pipeline_rank + k * self.pipeline_size for k in range(self.stages_per_rank)]

    def dims(self, world_size: int) -> ParallelDims:
        """The (pipeline, data_parallel, tensor_parallel) mesh: the ranks of one pipeline (each stage's
        tensor-parallel ranks too) share a replica; pipelines beyond the first shard their stages with FSDP."""
        return ParallelDims(
            world_size,
            pipeline=self.pipeline_size,
            tensor_parallel=self.tensor_parallel.size,
            shard=True,
            pipelined=True,
            expert_parallel=self.expert_parallel,
        )

    def problem(self, job: Job, net: BlockSequence) -> ConfigError | None:
        """The split, the schedule, the mesh, the micro-batches, the checkpoint."""
        problem = super().problem(job, net) or stage_split_problem(net, self.num_stages, self.blocks_per_stage)
        if problem is not None:
            return problem
        stages_per_rank, schedule, key = self.stages_per_rank, self.schedule, "strategy."
        if self.num_stages % stages_per_rank:
            return ConfigError(
                key + "stages_per_rank",
                f"is {stages_per_rank}, which does not divide the {self.num_stages} stages.",
                "use a divisor of strategy.num_stages (1 unless the schedule is interleaved_1f1b).",
            )
        if (schedule == "interleaved_1f1b") != (stages_per_rank > 1):
            return ConfigError(
                key + "stages_per_rank",
                f"is {stages_per_rank} with schedule {schedule}: interleaving means several stages per rank, the "
                "other schedules run one.",
                "use schedule=interleaved_1f1b with stages_per_rank >= 2, or stages_per_rank=1 with gpipe or 1f1b.",
            )
        ranks, tensor_parallel = self.pipeline_size, self.tensor_parallel.size
        if job.world_size % (ranks * tensor_parallel):
            split = f" x {tensor_parallel} tensor-parallel ranks per stage" if tensor_parallel > 1 else ""
            return ConfigError(
                "trainer.devices",
                f"gives {job.world_size} processes, not a multiple of the {ranks * tensor_parallel} ranks one "
                f"pipeline needs ({self.num_stages} stages / {stages_per_rank} per rank{split}).",
                f"use a multiple of {ranks * tensor_parallel} devices (the factor beyond is data parallel).",
            )
        microbatches, batch_size = self.microbatches, job.batch_size
        if batch_size % microbatches:
            return ConfigError(
                key + "microbatches",
                f"is {microbatches}, which does not divide data.batch_size={batch_size} into equal micro-batches.",
                f"choose microbatches dividing {batch_size}, or change data.batch_size.",
            )
        if schedule != "gpipe" and microbatches < ranks:
            return ConfigError(
                key + "microbatches",
                f"is {microbatches}, fewer than the {ranks} pipeline ranks: {schedule} needs at least one micro-batch "
                "in flight per rank.",
                f"use strategy.microbatches={ranks} or more (a multiple of {ranks} for interleaved_1f1b).",
            )
        if schedule == "interleaved_1f1b" and ranks < 2:
            return ConfigError(
                key + "stages_per_rank",
                f"is {stages_per_rank} of {self.num_stages} stages: one pipeline rank, which interleaved_1f1b cannot "
                "run (torch's schedule passes each stage's work to another rank).",
                "use at least 2 pipeline ranks (strategy.num_stages = 2 x stages_per_rank or more), or schedule=1f1b.",
            )
        if schedule == "interleaved_1f1b" and microbatches % ranks:
            return ConfigError(
                key + "microbatches",
                f"is {microbatches}; interleaved_1f1b runs micro-batches in rounds of {ranks} (the pipeline ranks).",
                f"use a multiple of {ranks}.",
            )
        if job.ckpt_path is not None and not is_sharded_checkpoint(job.ckpt_path):
            return ConfigError(
                "ckpt_path",
                f"{job.ckpt_path} is a single-file checkpoint; strategy=pipeline resumes only the sharded checkpoints "
                "it saves.",
                "resume it with the strategy that wrote it (or auto), or start the pipeline fresh with ckpt_path=null.",
            )
        return expert_parallel_problem(job, net, self.expert_parallel, ranks * tensor_parallel)

    def lay_out(self, model: BlockSequence, mesh: DeviceMesh, precision: str) -> list[StageModule]:
        """This rank's part of ``model`` (on the meta device): the modules of its stages, the others dropped, each
        split over its tensor-parallel ranks and then sharded over its data-parallel peers when it has them."""
        stages = split_blocks(block_sizes(model), self.num_stages, self.blocks_per_stage)
        kept = [
            StageModule(stage_modules(model, stages, stage))
            for stage in self.stages_of(mesh[PIPELINE].get_local_rank())
        ]
        keep_only(model, [module for stage in kept for module in stage.blocks])
        self.tensor_parallel.apply(model, mesh)
        if self.expert_parallel > 1:
            apply_expert_parallel(model, mesh[EXPERT])
        if mesh[DATA_PARALLEL].size() > 1:
            param_dtype = fsdp_param_dtype(precision)
            for stage_module in kept:
                # Gathered once per step, not once per micro-batch (torchtitan does the same under PP): the schedule
                # runs every micro-batch through the stage, and only its last backward reduces and reshards.
                apply_fsdp(
                    stage_module,
                    mesh[DATA_PARALLEL],
                    reshard_after_forward=False,
                    param_dtype=param_dtype,
                    reduce_dtype=torch.float32 if param_dtype is not None else None,
                    expert_shard_mesh=mesh[EXPERT_SHARD] if self.expert_parallel > 1 else None,
                )
        return kept

    def simulated_devices(self, job: Job) -> Generator[DeviceWork, None, None]:
        """Each rank of one pipeline (their data-parallel and tensor-parallel peers hold the same), laid out as in a
        real run over a fake process group of the job's size, with the micro-batches its schedule keeps in flight."""
        ranks, world, microbatches = self.pipeline_size, job.world_size, self.microbatches
        microbatch_size = job.batch_size // microbatches
        stages = split_blocks(block_sizes(job.new_module().net), self.num_stages, self.blocks_per_stage)
        for rank in range(ranks):
            # Data-parallel and tensor-parallel index 0: the first global rank of pipeline rank ``rank``.
            with fake_process_group(world, rank * world // ranks):
                mesh = self.dims(world).build_mesh("cpu")
                if rank == 0:  # what enters each block, then the head: a tensor-parallel rank's share of it
                    whole = job.new_module()
                    self.tensor_parallel.apply(whole.net, mesh)
                    example = job.data.example_batch(microbatch_size)[0].to("meta")
                    boundaries = block_inputs(whole.net, example)
                module = job.new_module()
                kept = self.lay_out(module.net, mesh, job.precision)
                stage_ids = self.stages_of(rank)
                first, last = 0 in stage_ids, self.num_stages - 1 in stage_ids
                # Each micro-batch, each of the rank's stages sends its output on to the next stage and its input's
                # gradient back to the previous one, both on other ranks.
                sent = sum(
                    _bytes(boundaries[stages[stage].stop]) * (stage < self.num_stages - 1)
                    + _bytes(boundaries[stages[stage].start]) * (stage > 0)
                    for stage in stage_ids
                )
                sends = sum((stage < self.num_stages - 1) + (stage > 0) for stage in stage_ids)
                link = group_link("send", mesh[PIPELINE].get_group(), job.devices, self.dims(world).world_dim)
                yield DeviceWork(
                    f"rank {rank} (stage {', '.join(map(str, stage_ids))})",
                    module,
                    list(kept),
                    microbatch_size,
                    microbatches=microbatches,
                    in_flight=_in_flight(self.schedule, microbatches, ranks, rank, self.stages_per_rank),
                    stage_input=None if first else boundaries[stages[stage_ids[0]].start],
                    stage_output=None if last else boundaries[stages[stage_ids[-1]].stop],
                    last=last,
                    receive_buffers=True,
                    forward_in_backward=True,
                    unsimulated_collectives={link.key: sent * microbatches},
                    unsimulated_calls={link.key: sends * microbatches},
                )

    def blocks_per_device(self, net: BlockSequence) -> list[int]:
        """Blocks each rank of one pipeline runs: those of its stages."""
        stages = split_blocks(block_sizes(net), self.num_stages, self.blocks_per_stage)
        return [sum(len(stages[stage]) for stage in self.stages_of(rank)) for rank in range(self.pipeline_size)]

    def at_depth(self, job: Job, blocks_per_stage: int) -> Job:
        return staged_at_depth(job, self, blocks_per_stage)

    def setting_values(self) -> dict[Setting, Any]:
        return {
            **super().setting_values(),
            Setting.NUM_STAGES: self.num_stages,
            Setting.MICROBATCHES: self.microbatches,
            Setting.SCHEDULE: self.schedule,
            Setting.STAGES_PER_RANK: self.stages_per_rank,
            Setting.EXPERT_PARALLEL_SIZE: self.expert_parallel,
        }

    def bubble_fraction(self) -> float:
        """The share of a step each rank idles, waiting for the pipeline to fill and drain: (S - 1) / (v M + S - 1)
        for S ranks, M micro-batches and v stages per rank (GPipe and 1F1B: v = 1; interleaving cuts each rank's
        idle stretches v-fold)."""
        ranks = self.pipeline_size
        return (ranks - 1) / (self.stages_per_rank * self.microbatches + ranks - 1)

    def memory_saving_changes(self, job: Job) -> Iterator[Change]:
        """Smaller micro-batches (fewer activations each, and 1F1B keeps no more of them in flight), then twice the
        stages over twice the devices (each holds half the blocks)."""
        yield Change(
            replace(job, layout=replace(self, microbatches=2 * self.microbatches)), frozenset({Setting.MICROBATCHES})
        )
        yield Change(
            replace(job, layout=replace(self, num_stages=2 * self.num_stages), devices=2 * job.devices),
            frozenset({Setting.NUM_STAGES, Setting.DEVICES}),
        )

    def search_space(self, job: Job, global_batch: int) -> Iterator[Change]:
        """Pipelines of each size from 2 ranks, each stage split over each tensor-parallel size within a node, the
        rest data parallel; under 1F1B and interleaved 1F1B (two stages per rank), up to
        ``plan_search.max_pipeline_ranks`` ranks, with the most micro-batches up to 2 per pipeline rank that split
        the replica's batch in rounds of the ranks (a bubble of at most (S - 1) / (3 S - 1); each micro-batch costs
        the simulation a pass through every stage, and the step-time model does not see a GPU's lower efficiency on
        smaller micro-batches). GPipe is left out: its bubble is 1F1B's, its activations more. For a mixture of
        experts, each with each expert-parallel size within a node that divides the experts and the replicas."""
        world, experts = job.world_size, expert_counts(job.meta_net())
        for ranks in [r for r in divisors(world)[1:] if r <= job.search.max_pipeline_ranks]:
            for size in divisors(job.devices):
                if world % (ranks * size):
                    continue
                replicas = ParallelDims(world, pipeline=ranks, tensor_parallel=size).data_parallel
                if global_batch % replicas:
                    continue
                batch = global_batch // replicas
                rounds = [m for m in divisors(batch) if m % ranks == 0 and m <= 2 * ranks]
                if not rounds:
                    continue
                microbatches = rounds[-1]
                schedules: tuple[tuple[ScheduleName, int], ...] = (("1f1b", 1), ("interleaved_1f1b", 2))
                for (schedule, per_rank), expert_size in product(
                    schedules, expert_parallel_sizes(experts, replicas, job.devices)
                ):
                    layout = replace(
                        self,
                        num_stages=ranks * per_rank,
                        stages_per_rank=per_rank,
                        schedule=schedule,
                        microbatches=microbatches,
                        tensor_parallel=replace(self.tensor_parallel, size=size),
                        expert_parallel=expert_size,
                    )
                    sets = {Setting.NUM_STAGES, Setting.MICROBATCHES}
                    sets |= {Setting.SCHEDULE, Setting.STAGES_PER_RANK} if per_rank > 1 else set()
                    sets |= {Setting.TENSOR_PARALLEL_SIZE} if size > 1 else set()
                    sets |= {Setting.EXPERT_PARALLEL_SIZE} if expert_size > 1 else set()
                    yield Change(replace(job, layout=layout, batch_size=batch), frozenset(sets))
