"""``strategy=pipeline``: one process per pipeline stage, micro-batches flowing through them
(torch.distributed.pipelining); the layout (stages, mesh, FSDP and tensor parallelism per stage) is
``project.layouts.pipeline_layout``'s.

Lightning has no pipeline strategy; this one runs the schedule (forward and backward of every micro-batch
together) in place of the ``loss.backward()`` of Lightning's backward (its hooks, gradient accumulation and autocast
stay), and forward-only in ``validation_step`` (and ``row_values``); gradient clipping by norm takes the norm over
all stages. The last stage adds each micro-batch to the metrics as the schedule computes its loss, so it keeps no
micro-batch's outputs past its backward (torch's schedule would merge them all: a vocabulary's logits per sample of
the whole batch). The schedule cuts the batch's inputs and target into micro-batches by rows (whole samples: what
rides with a row, as a preference pair's index, stays with it), and the task computes each micro-batch's loss
(``TaskModule.loss``) as it computes a batch's.
Everything else (optimizers, metrics, loggers, checkpoints) is Lightning's, unchanged. The model arrives on the meta
device, so a rank allocates only its own stages.
"""

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast, get_args

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from project.checkpointing.files import META_FILE, is_sharded_checkpoint
from project.data.datamodule import trainer_data
from project.job.task import TaskModule
from project.layouts.pipeline_layout import PipelineLayout, ScheduleName, StageModule
from project.layouts.sharded_layout import TensorParallel
from project.models.sequence import BlockSequence
from project.options.option_types import PositiveInt
from project.parallel.dims import PIPELINE
from project.parallel.parallelize import clip_grad_norm_
from project.strategies.laid_out import RowFunction
from project.strategies.sharded import ShardedStrategy

if TYPE_CHECKING:  # torch's private base class of the schedules, for annotations
    from torch.distributed.pipelining.schedules import _PipelineSchedule

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
assert list(SCHEDULES) == list(get_args(ScheduleName))

# Ranks that hold no outputs update no metrics but must join their epoch-end reduction; torchmetrics warns then.
warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method.*")


class PipelineStrategy(ShardedStrategy):
    """``num_stages`` stages over ``num_stages / stages_per_rank`` ranks per pipeline, each stage split over
    ``tensor_parallel_size`` ranks."""

    layout: PipelineLayout

    def __init__(
        self,
        num_stages: PositiveInt,
        schedule: ScheduleName = "1f1b",
        microbatches: PositiveInt = 4,
        stages_per_rank: PositiveInt = 1,
        blocks_per_stage: list[PositiveInt] | None = None,
        tensor_parallel_size: PositiveInt = 1,
        sequence_parallel: bool = True,
        expert_parallel_size: PositiveInt = 1,
        **kwargs: Any,
    ) -> None:
        layout = PipelineLayout(
            # The last stage's logits go through the schedule, which passes plain tensors: gathered, not split.
            tensor_parallel=TensorParallel(tensor_parallel_size, sequence_parallel, loss_parallel=False),
            num_stages=num_stages,
            schedule=schedule,
            microbatches=microbatches,
            stages_per_rank=stages_per_rank,
            blocks_per_stage=tuple(blocks_per_stage) if blocks_per_stage is not None else None,
            expert_parallel=expert_parallel_size,
        )
        super().__init__(layout, **kwargs)
        self.stage_modules: list[StageModule] = []
        self._train_schedule: _PipelineSchedule | None = None
        self._eval_schedule: _PipelineSchedule | None = None
        self._eval_rows = 0  # of every forward-only batch, padded: fixed by the first
        self._eval_rows_left = 0  # of the batch under way, before its padding: its micro-batches not yet handed on
        self._eval_handler: Callable[[torch.Tensor, torch.Tensor], object] | None = None
        self._batch: tuple[torch.Tensor, torch.Tensor] | None = None

    def summed_over_stages(self, counts: dict[str, int]) -> dict[str, int]:
        group = self.device_mesh[PIPELINE].get_group()
        gathered: list[dict[str, int]] = [{} for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather_object(gathered, counts, group=group)  # by name: the ranks' layers differ
        return {name: sum(rank.get(name, 0) for rank in gathered) for name in counts}

    @property
    def stage_ids(self) -> list[int]:
        """This rank's stages."""
        return self.layout.stages_of(self.device_mesh[PIPELINE].get_local_rank())

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last_stage(self) -> bool:
        return self.layout.num_stages - 1 in self.stage_ids

    def parallelize(self, model: BlockSequence) -> None:
        if not self.stage_modules:
            self.stage_modules = self.layout.lay_out(model, self.device_mesh, self.precision_plugin.precision)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Each rank reads its own blocks and their optimizer state from a sharded checkpoint.

        Lightning's loader insists on DTensor parameters, which a stage has only when sharded or split; and the
        optimizer's parameter groups differ per rank, so only their tensors are read back: the groups'
        hyperparameters come from the config, and their learning rates from where the LR schedules left them.
        """
        path = Path(self.broadcast(str(checkpoint_path)))
        if not is_sharded_checkpoint(path):
            raise ValueError(f"strategy=pipeline resumes from the sharded checkpoints it saves; {path} is not one")
        assert self.model is not None and self.lightning_module is not None  # (as in Lightning's own load_checkpoint)
        model_state = get_model_state_dict(self.model)
        dcp.load({"state_dict": model_state}, checkpoint_id=path)
        self.model.load_state_dict(model_state, strict=self.lightning_module.strict_loading)  # LoRA: no base
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
                module, stage, self.layout.num_stages, self.root_device, group=self.device_mesh[PIPELINE].get_group()
            )
            for module, stage in zip(self.stage_modules, self.stage_ids)
        ]
        schedule_class = SCHEDULES[self.layout.schedule]
        stage_arg = stages if self.layout.stages_per_rank > 1 else stages[0]  # the multi-stage schedules take a list
        # scale_grads=False: the schedule would divide all of .grad by the micro-batches after each step, also
        # what earlier batches of a gradient accumulation put there; the loss is scaled instead (_microbatch_loss).
        return schedule_class(stage_arg, n_microbatches=self.layout.microbatches, loss_fn=loss_fn, scale_grads=False)

    @property
    def _loss_divisor(self) -> int:
        """What each micro-batch's mean loss is divided by, so that the gradients add up to those Lightning takes
        from one batch: the micro-batches of the batch, times the batches accumulated per optimizer step."""
        return self.layout.microbatches * cast(TaskModule, self.lightning_module).trainer.accumulate_grad_batches

    def _microbatch_loss(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What the schedule backpropagates from a micro-batch; unmetered: torch 2.13 calls it on stand-in outputs
        too, when its first step infers the stages' shapes."""
        return cast(TaskModule, self.lightning_module).loss(outputs, target).value / self._loss_divisor

    def _metered(self, schedule: "_PipelineSchedule") -> "_PipelineSchedule":
        """``schedule``, adding each micro-batch to the training metrics as it computes the micro-batch's loss.

        Only the schedule's ``_compute_loss`` (private) sees the real micro-batches, so the metrics are fed there:
        in its place, this computes the loss itself (torch 2.11 calls it with the outputs and the target, 2.13 adds
        its ``loss_kwargs``, which this strategy never passes)."""
        module = cast(TaskModule, self.lightning_module)

        def compute_and_meter(outputs: torch.Tensor, target: torch.Tensor, loss_kwargs=None) -> torch.Tensor:
            loss = module.loss(outputs, target)
            module.meter("train", loss)
            return loss.value / self._loss_divisor

        schedule._compute_loss = compute_and_meter  # type: ignore[method-assign]
        return schedule

    def _handed_on(self, schedule: "_PipelineSchedule") -> "_PipelineSchedule":
        """A forward-only ``schedule`` whose last stage hands each micro-batch's outputs and targets, less the batch's
        padding, to ``_eval_handler`` (through the schedule's private ``_compute_loss``, as ``_metered``)."""

        def hand_on(outputs: torch.Tensor, target: torch.Tensor, loss_kwargs=None) -> torch.Tensor:
            real = min(len(outputs), self._eval_rows_left)  # the rest is the batch's padding, at its end
            self._eval_rows_left -= real
            if real:
                assert self._eval_handler is not None  # set by _forward_only
                self._eval_handler(outputs[:real], target[:real])
            return outputs.new_zeros(())  # no backward: the schedule only collects it

        schedule._compute_loss = hand_on  # type: ignore[method-assign]
        return schedule

    def _run_schedule(self, schedule, inputs: torch.Tensor, target: torch.Tensor) -> None:
        """Feed the inputs on the first stage and the targets on the last; the last stage's loss function takes each
        micro-batch's outputs (``_metered``, ``_handed_on``), so no outputs are kept to return."""
        args = (inputs,) if self.holds_first_stage else ()
        schedule(*args, target=target if self.holds_last_stage else None, losses=[], return_outputs=False)

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
        if self._train_schedule is None:
            self._train_schedule = self._metered(self._make_schedule(loss_fn=self._microbatch_loss))
        assert self._batch is not None  # set by training_step
        inputs, target = self._batch
        self._batch = None
        with self.precision_plugin.train_step_context():  # autocast under bf16-mixed, as Lightning's training_step
            self._run_schedule(self._train_schedule.step, inputs, target)

    def clip_grad_norm_(self, parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient: every stage's, every data-parallel shard's."""
        return clip_grad_norm_(parameters, max_norm, self.device_mesh[PIPELINE].get_group())

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Forward only (``_forward_only``), each micro-batch added to the validation metrics."""
        module = cast(TaskModule, self.lightning_module)

        def meter(outputs: torch.Tensor, target: torch.Tensor) -> None:
            module.meter("val", module.loss(outputs, target))

        with self.precision_plugin.val_step_context():
            self._forward_only(*batch, meter)
        module.log_metrics("val")

    def row_values(self, net: nn.Module, inputs: torch.Tensor, target: torch.Tensor, fn: RowFunction) -> torch.Tensor:
        """Forward only through this rank's stages of ``net`` (``_forward_only``); the last stage's values go to this
        pipeline's other ranks (a broadcast over its stages)."""
        values: list[torch.Tensor] = []
        self._forward_only(inputs, target, lambda outputs, target: values.append(fn(outputs, target).float()))
        rows = torch.cat(values) if self.holds_last_stage else torch.empty(len(inputs), device=self.root_device)
        group = self.device_mesh[PIPELINE].get_group()
        last = (self.layout.num_stages - 1) % self.layout.pipeline_size  # the pipeline rank of the last stage
        torch.distributed.broadcast(rows, group_src=last, group=group)
        return rows

    def _forward_only(
        self, inputs: torch.Tensor, target: torch.Tensor, handler: Callable[[torch.Tensor, torch.Tensor], object]
    ) -> None:
        """Run a batch forward through the stages; the last stage hands each micro-batch's outputs and targets to
        ``handler``. Stages fix their activation shapes on first use, so every batch is padded to one size: the
        first, largest batch, rounded up to equal micro-batches of whole samples (the data's
        ``sequences_per_sample`` rows each). The micro-batches come in order, so the padding's rows, at the end,
        are left out (``_handed_on``)."""
        if self._eval_schedule is None:
            self._eval_schedule = self._handed_on(self._make_schedule(loss_fn=self._eval_loss))
            rows_per_sample = trainer_data(cast(TaskModule, self.lightning_module).trainer).sequences_per_sample
            group = self.layout.microbatches * rows_per_sample
            self._eval_rows = -(-len(inputs) // group) * group
        self._eval_rows_left, self._eval_handler = len(inputs), handler
        padding = self._eval_rows - len(inputs)
        if padding:
            inputs = torch.cat([inputs, inputs[:1].expand(padding, *inputs.shape[1:])])
            target = torch.cat([target, target[:1].expand(padding, *target.shape[1:])])
        self._run_schedule(self._eval_schedule.eval, inputs, target)
        self._eval_handler = None

    def _eval_loss(self, outputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss function a forward-only schedule needs for its last stage to call ``_compute_loss`` at all
        (``_handed_on`` replaces that); torch's evaluation calls it directly neither in 2.11 nor in 2.13."""
        return cast(TaskModule, self.lightning_module).loss(outputs, target).value
