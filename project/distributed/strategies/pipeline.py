"""``strategy=pipeline``: one process per pipeline stage, micro-batches flowing through them
(torch.distributed.pipelining).

The model's blocks are split into stages (``project.distributed.parallelize.split_blocks``); rank r of a pipeline
keeps only the
blocks of its stages. A batch is cut into ``microbatches`` and a schedule (GPipe, 1F1B, interleaved 1F1B) overlaps
their forward and backward passes across the stages, so fewer devices sit idle than in ``model_parallel``: the idle
fraction (bubble) is (S - 1) / (M + S - 1) for S stages and M micro-batches. When there are more ranks than one
pipeline needs, the rest is data parallel: the ranks form a (pipeline x data_parallel) mesh and each stage is
sharded with FSDP over its data-parallel group.

Lightning has no pipeline strategy; this one runs the schedule (forward and backward of every micro-batch
together) in place of the ``loss.backward()`` of Lightning's backward (its hooks, gradient accumulation and autocast
stay), and forward-only in ``validation_step``; gradient clipping by norm takes the norm over all stages. Everything
else (optimizers, metrics, loggers, checkpoints) is Lightning's, unchanged. The model arrives on the meta device, so
a rank allocates only its own stages.
"""

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.connector import _convert_precision_to_unified_args
from omegaconf import DictConfig
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from project.checkpointing.files import META_FILE, is_sharded_checkpoint
from project.config.build import build_strategy
from project.config.errors import ConfigError
from project.config.option_types import PositiveInt
from project.distributed.dims import DATA_PARALLEL, PIPELINE, ParallelDims, divisors
from project.distributed.parallelize import (
    apply_fsdp,
    block_sizes,
    clip_grad_norm_,
    fsdp_param_dtype,
    keep_only,
    split_blocks,
    stage_modules,
)
from project.distributed.strategies.sharded import ShardedStrategy
from project.distributed.strategies.stages import check_stage_split
from project.memory.counts import group_link
from project.memory.simulation import DeviceWork, TaskModule, block_inputs, fake_process_group
from project.models.sequence import BlockSequence

if TYPE_CHECKING:  # torch's private base class of the schedules, for annotations
    from torch.distributed.pipelining.schedules import _PipelineSchedule

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b"]  # strategy.schedule's values, checked before launch
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
assert list(SCHEDULES) == list(get_args(ScheduleName))

# Ranks that hold no outputs update no metrics but must join their epoch-end reduction; torchmetrics warns then.
warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method.*")


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


class PipelineStrategy(ShardedStrategy):
    """``num_stages`` stages over ``num_stages / stages_per_rank`` ranks per pipeline, each stage split over
    ``tensor_parallel_size`` ranks; batches must be ``(inputs, targets)``."""

    def __init__(
        self,
        num_stages: PositiveInt,
        schedule: ScheduleName = "1f1b",
        microbatches: PositiveInt = 4,
        stages_per_rank: PositiveInt = 1,
        blocks_per_stage: list[PositiveInt] | None = None,
        **kwargs: Any,
    ) -> None:
        # The last stage's logits go through the schedule, which passes plain tensors: gathered, not split.
        super().__init__(loss_parallel=False, **kwargs)
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.stages_per_rank = stages_per_rank
        self.blocks_per_stage = list(blocks_per_stage) if blocks_per_stage is not None else None
        self.pipeline_size = num_stages // stages_per_rank
        self.stage_modules: list[StageModule] = []
        self._train_schedule: _PipelineSchedule | None = None
        self._eval_schedule: _PipelineSchedule | None = None
        self._eval_batch_size = 0
        self._batch: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def pipeline_ranks(cfg: DictConfig) -> int:
        """Ranks one pipeline spans: its stages over the stages each rank runs."""
        return cfg.strategy.num_stages // cfg.strategy.stages_per_rank

    def dims(self, world_size: int) -> ParallelDims:
        """The (pipeline, data_parallel, tensor_parallel) mesh: the ranks of one pipeline (each stage's
        tensor-parallel ranks too) share a replica; pipelines beyond the first shard their stages with FSDP."""
        return ParallelDims(
            world_size,
            pipeline=self.pipeline_size,
            tensor_parallel=self.tensor_parallel.size,
            shard=True,
            pipelined=True,
        )

    @classmethod
    def check_config(cls, cfg: DictConfig, net: BlockSequence, ckpt_path: str | None) -> None:
        """Rules checked before launch (``project.config.job``): the split, the schedule, the mesh, the
        micro-batches."""
        super().check_config(cfg, net, ckpt_path)
        check_stage_split(cfg, net)
        strategy, key = cfg.strategy, "strategy."
        stages_per_rank, schedule = strategy.stages_per_rank, strategy.schedule
        if strategy.num_stages % stages_per_rank:
            raise ConfigError(
                key + "stages_per_rank",
                f"is {stages_per_rank}, which does not divide the {strategy.num_stages} stages.",
                "use a divisor of strategy.num_stages (1 unless the schedule is interleaved_1f1b).",
            )
        if (schedule == "interleaved_1f1b") != (stages_per_rank > 1):
            raise ConfigError(
                key + "stages_per_rank",
                f"is {stages_per_rank} with schedule {schedule}: interleaving means several stages per rank, the "
                "other schedules run one.",
                "use schedule=interleaved_1f1b with stages_per_rank >= 2, or stages_per_rank=1 with gpipe or 1f1b.",
            )
        ranks, processes = cls.pipeline_ranks(cfg), strategy.processes * cfg.trainer.num_nodes
        tensor_parallel = strategy.tensor_parallel_size
        if processes % (ranks * tensor_parallel):
            split = f" x {tensor_parallel} tensor-parallel ranks per stage" if tensor_parallel > 1 else ""
            raise ConfigError(
                "trainer.devices",
                f"gives {processes} processes, not a multiple of the {ranks * tensor_parallel} ranks one pipeline "
                f"needs ({strategy.num_stages} stages / {stages_per_rank} per rank{split}).",
                f"use a multiple of {ranks * tensor_parallel} devices (the factor beyond is data parallel).",
            )
        microbatches, batch_size = strategy.microbatches, cfg.data.batch_size
        if batch_size % microbatches:
            raise ConfigError(
                key + "microbatches",
                f"is {microbatches}, which does not divide data.batch_size={batch_size} into equal micro-batches.",
                f"choose microbatches dividing {batch_size}, or change data.batch_size.",
            )
        if schedule != "gpipe" and microbatches < ranks:
            raise ConfigError(
                key + "microbatches",
                f"is {microbatches}, fewer than the {ranks} pipeline ranks: {schedule} needs at least one micro-batch "
                "in flight per rank.",
                f"use strategy.microbatches={ranks} or more (a multiple of {ranks} for interleaved_1f1b).",
            )
        if schedule == "interleaved_1f1b" and microbatches % ranks:
            raise ConfigError(
                key + "microbatches",
                f"is {microbatches}; interleaved_1f1b runs micro-batches in rounds of {ranks} (the pipeline ranks).",
                f"use a multiple of {ranks}.",
            )
        if ckpt_path is not None and not is_sharded_checkpoint(ckpt_path):
            raise ConfigError(
                "ckpt_path",
                f"{ckpt_path} is a single-file checkpoint; strategy=pipeline resumes only the sharded checkpoints it "
                "saves.",
                "resume it with the strategy that wrote it (or auto), or start the pipeline fresh with ckpt_path=null.",
            )

    def stages_of(self, pipeline_rank: int) -> list[int]:
        """The stages pipeline rank r runs: r, r + P, r + 2P, ... (interleaved when several)."""
        return [pipeline_rank + k * self.pipeline_size for k in range(self.stages_per_rank)]

    @property
    def stage_ids(self) -> list[int]:
        """This rank's stages."""
        return self.stages_of(self.device_mesh[PIPELINE].get_local_rank())

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def parallelize(self, model: BlockSequence) -> None:
        """Called from the LightningModule's ``configure_model`` with its plain (meta) model."""
        if not self.stage_modules:
            self.stage_modules = self.lay_out(model, self.device_mesh, self.precision_plugin.precision)

    def lay_out(self, model: BlockSequence, mesh: DeviceMesh, precision: str) -> list["StageModule"]:
        """This rank's part of ``model`` (on the meta device): the modules of its stages, the others dropped, each
        split over its tensor-parallel ranks and then sharded over its data-parallel peers when it has them."""
        stages = split_blocks(block_sizes(model), self.num_stages, self.blocks_per_stage)
        kept = [
            StageModule(stage_modules(model, stages, stage))
            for stage in self.stages_of(mesh[PIPELINE].get_local_rank())
        ]
        keep_only(model, [module for stage in kept for module in stage.blocks])
        self.tensor_parallel.apply(model, mesh)
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
                )
        return kept

    @classmethod
    def memory_saving_changes(cls, cfg: DictConfig) -> Iterator[tuple[str, dict[str, Any]]]:
        """For the memory plan's suggestions: smaller micro-batches (fewer activations each, and 1F1B keeps no more
        of them in flight), then twice the stages over twice the devices (each holds half the blocks)."""
        strategy, devices = cfg.strategy, cfg.trainer.devices
        yield (
            f"strategy.microbatches={2 * strategy.microbatches}",
            {"strategy.microbatches": 2 * strategy.microbatches},
        )
        yield (
            f"strategy.num_stages={2 * strategy.num_stages} trainer.devices={2 * devices}",
            {
                "strategy.num_stages": 2 * strategy.num_stages,
                "trainer.devices": 2 * devices,
                "strategy.processes": 2 * devices,
            },
        )

    @classmethod
    def search_layouts(cls, cfg: DictConfig, global_batch: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """For plan=search: pipelines of each size from 2 ranks, each stage split over each tensor-parallel size
        within a node, the rest data parallel, each replica taking its share of ``global_batch``; under 1F1B and
        interleaved 1F1B (two stages per rank), up to ``plan_search.max_pipeline_ranks`` ranks, with the most
        micro-batches up to 2 per pipeline rank that split the replica's batch in rounds of the ranks (a bubble of
        at most (S - 1) / (3 S - 1); each micro-batch costs the simulation a pass through every stage, and the
        step-time model does not see a GPU's lower efficiency on smaller micro-batches). GPipe is left out: its
        bubble is 1F1B's, its activations more. As overrides (text, and keys to values); the run's checks drop those
        the model cannot split."""
        world = cfg.strategy.processes * cfg.trainer.num_nodes
        for ranks in [r for r in divisors(world)[1:] if r <= cfg.plan_search.max_pipeline_ranks]:
            for size in divisors(cfg.trainer.devices):
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
                for schedule, per_rank in (("1f1b", 1), ("interleaved_1f1b", 2)):
                    words = [f"strategy.num_stages={ranks * per_rank}", f"strategy.microbatches={microbatches}"]
                    if per_rank > 1:
                        words += [f"strategy.schedule={schedule}", f"strategy.stages_per_rank={per_rank}"]
                    if size > 1:
                        words.append(f"strategy.tensor_parallel_size={size}")
                    yield (
                        " ".join(words),
                        {
                            "strategy.num_stages": ranks * per_rank,
                            "strategy.stages_per_rank": per_rank,
                            "strategy.schedule": schedule,
                            "strategy.microbatches": microbatches,
                            "strategy.tensor_parallel_size": size,
                            "data.batch_size": batch,
                        },
                    )

    @classmethod
    def blocks_per_device(cls, cfg: DictConfig, net: BlockSequence) -> list[int]:
        """Blocks each rank of one pipeline runs: those of its stages (the memory plan's devices, in order)."""
        strategy, ranks = cfg.strategy, cls.pipeline_ranks(cfg)
        stages = split_blocks(block_sizes(net), strategy.num_stages, strategy.blocks_per_stage)
        return [sum(len(stages[rank + k * ranks]) for k in range(strategy.stages_per_rank)) for rank in range(ranks)]

    @classmethod
    def bubble_fraction(cls, cfg: DictConfig) -> float:
        """For the step-time model: the share of a step each rank idles, waiting for the pipeline to fill and
        drain: (S - 1) / (v M + S - 1) for S ranks, M micro-batches and v stages per rank (GPipe and 1F1B: v = 1;
        interleaving cuts each rank's idle stretches v-fold)."""
        ranks, strategy = cls.pipeline_ranks(cfg), cfg.strategy
        return (ranks - 1) / (strategy.stages_per_rank * strategy.microbatches + ranks - 1)

    @classmethod
    def simulated_devices(cls, cfg: DictConfig, new_module: Callable[[], TaskModule]) -> Iterator[DeviceWork]:
        """For the memory plan: each rank of one pipeline (their data-parallel and tensor-parallel peers hold the
        same), laid out as in a real run over a fake process group of the job's size, with the micro-batches its
        schedule keeps in flight."""
        strategy, ranks = build_strategy(cfg.strategy), cls.pipeline_ranks(cfg)
        world, microbatches = cfg.strategy.processes * cfg.trainer.num_nodes, strategy.microbatches
        microbatch_size = cfg.data.batch_size // microbatches
        precision = _convert_precision_to_unified_args(cfg.trainer.precision)
        stages = split_blocks(block_sizes(new_module().net), strategy.num_stages, strategy.blocks_per_stage)
        for rank in range(ranks):
            # Data-parallel and tensor-parallel index 0: the first global rank of pipeline rank ``rank``.
            with fake_process_group(world, rank * world // ranks):
                mesh = strategy.dims(world).build_mesh("cpu")
                if rank == 0:  # what enters each block, then the head: a tensor-parallel rank's share of it
                    whole = new_module()
                    strategy.tensor_parallel.apply(whole.net, mesh)
                    example = whole.example_batch(microbatch_size, cfg.data)[0].to("meta")
                    boundaries = block_inputs(whole.net, example)
                module = new_module()
                kept = strategy.lay_out(module.net, mesh, precision)
                stage_ids = strategy.stages_of(rank)
                first, last = 0 in stage_ids, strategy.num_stages - 1 in stage_ids
                # Each micro-batch, each of the rank's stages sends its output on to the next stage and its input's
                # gradient back to the previous one, both on other ranks.
                sent = sum(
                    _bytes(boundaries[stages[stage].stop]) * (stage < strategy.num_stages - 1)
                    + _bytes(boundaries[stages[stage].start]) * (stage > 0)
                    for stage in stage_ids
                )
                link = group_link(
                    "send", mesh[PIPELINE].get_group(), cfg.trainer.devices, strategy.dims(world).world_dim
                )
                yield DeviceWork(
                    f"rank {rank} (stage {', '.join(map(str, stage_ids))})",
                    module,
                    kept,
                    microbatch_size,
                    microbatches=microbatches,
                    in_flight=_in_flight(strategy.schedule_name, microbatches, ranks, rank, strategy.stages_per_rank),
                    stage_input=None if first else boundaries[stages[stage_ids[0]].start],
                    stage_output=None if last else boundaries[stages[stage_ids[-1]].stop],
                    last=last,
                    receive_buffers=True,
                    keeps_outputs=last,
                    forward_in_backward=True,
                    unsimulated_collectives={link.key: sent * microbatches},
                )

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Each rank reads its own blocks and their optimizer state from a sharded checkpoint.

        Lightning's loader insists on DTensor parameters, which a stage has only when sharded or split; and the
        optimizer's parameter groups differ per rank, so only their tensors are read back: the groups'
        hyperparameters come from the config, and their learning rates from where the LR schedules left them.
        """
        path = Path(self.broadcast(str(checkpoint_path)))
        if not is_sharded_checkpoint(path):
            raise ValueError(f"strategy=pipeline resumes from the sharded checkpoints it saves; {path} is not one")
        assert self.model is not None  # (as in Lightning's own load_checkpoint)
        model_state = get_model_state_dict(self.model)
        dcp.load({"state_dict": model_state}, checkpoint_id=path)
        self.model.load_state_dict(model_state)
        for index, optimizer in enumerate(self.optimizers):
            optimizer_state = get_optimizer_state_dict(self.model, optimizer)
            dcp.load({f"optimizer_{index}": {"state": optimizer_state["state"]}}, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, optimizer_state)
        checkpoint = torch.load(path / META_FILE, weights_only=weights_only)
        # Lightning restores the schedules' own state, but a group's current rate lives in the optimizer's groups;
        # without this, the first steps after a resume would run at the config's rate.
        for optimizer, schedule in zip(self.optimizers, checkpoint.get("lr_schedulers", [])):
            for group, rate in zip(optimizer.param_groups, schedule.get("_last_lr", [])):
                group["lr"] = rate
        return checkpoint

    def _make_schedule(self, loss_fn) -> "_PipelineSchedule":
        stages = [
            PipelineStage(
                module, stage, self.num_stages, self.root_device, group=self.device_mesh[PIPELINE].get_group()
            )
            for module, stage in zip(self.stage_modules, self.stage_ids)
        ]
        schedule_class = SCHEDULES[self.schedule_name]
        stage_arg = stages if self.stages_per_rank > 1 else stages[0]  # the multi-stage schedules take a list
        # scale_grads=False: the schedule would divide all of .grad by the micro-batches after each step, also
        # what earlier batches of a gradient accumulation put there; the loss is scaled instead (_microbatch_loss).
        return schedule_class(stage_arg, n_microbatches=self.microbatches, loss_fn=loss_fn, scale_grads=False)

    @property
    def _loss_divisor(self) -> int:
        """What each micro-batch's mean loss is divided by, so that the gradients add up to those Lightning takes
        from one batch: the micro-batches of the batch, times the batches accumulated per optimizer step."""
        return self.microbatches * cast(TaskModule, self.lightning_module).trainer.accumulate_grad_batches

    def _microbatch_loss(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cast(TaskModule, self.lightning_module).criterion(outputs, target) / self._loss_divisor

    def _run_schedule(self, schedule, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor | None:
        """Feed the inputs on the first stage; the last stage returns the merged outputs, other ranks None."""
        args = (inputs,) if self.holds_first_stage else ()
        return schedule(*args, **kwargs)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Only registers the metrics: Lightning zeroes gradients between ``training_step`` and ``backward``, so
        the schedule (forward and backward of every micro-batch) runs in ``backward``."""
        self._batch = batch
        cast(TaskModule, self.lightning_module).log_metrics("train")
        return torch.zeros((), device=self.root_device)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Lightning's ``Strategy.backward`` (the ``on_before_backward`` / ``on_after_backward`` hooks around it),
        with the pipeline schedule where the precision plugin would call ``loss.backward()``."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        assert module is not None  # (as in Lightning's own backward)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._train_schedule_step()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _train_schedule_step(self) -> None:
        module = cast(TaskModule, self.lightning_module)
        if self._train_schedule is None:
            self._train_schedule = self._make_schedule(loss_fn=self._microbatch_loss)
        assert self._batch is not None  # set by training_step
        (inputs, target), self._batch = self._batch, None
        losses: list[torch.Tensor] = []
        with self.precision_plugin.train_step_context():  # autocast under bf16-mixed, as Lightning's training_step
            logits = self._run_schedule(
                self._train_schedule.step, inputs, target=target if self.holds_last_stage else None, losses=losses
            )
        if self.holds_last_stage:
            # Equal micro-batches: their scaled losses add up to the batch's mean loss over the accumulation.
            batch_loss = torch.stack(losses).sum() * module.trainer.accumulate_grad_batches
            assert logits is not None  # the last stage's merged outputs
            module.update_metrics("train", logits, target, batch_loss)

    def clip_grad_norm_(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient: every stage's, every data-parallel shard's."""
        return clip_grad_norm_(parameters, max_norm, self.device_mesh[PIPELINE].get_group())

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Forward only. Stages fix their activation shapes on first use, so every evaluation batch is padded to
        one size (the first, largest batch, rounded up to equal micro-batches) and the padding's outputs are dropped
        before the metrics see them."""
        module = cast(TaskModule, self.lightning_module)
        inputs, target = batch
        if self._eval_schedule is None:
            self._eval_schedule = self._make_schedule(loss_fn=None)
            self._eval_batch_size = -(-len(inputs) // self.microbatches) * self.microbatches
        size = len(inputs)
        padding = self._eval_batch_size - size
        if padding:
            inputs = torch.cat([inputs, inputs[:1].expand(padding, *inputs.shape[1:])])
        with self.precision_plugin.val_step_context():
            logits = self._run_schedule(self._eval_schedule.eval, inputs)
        if self.holds_last_stage:
            assert logits is not None  # the last stage's merged outputs
            logits = logits[:size]
            module.update_metrics("val", logits, target, module.criterion(logits, target))
        module.log_metrics("val")
