"""``strategy=pipeline``: one process per pipeline stage, micro-batches flowing through them (torch.distributed.pipelining).

The model's blocks are split into stages (``project.parallel.split_blocks``); rank r of a pipeline keeps only the
blocks of its stages. A batch is cut into ``microbatches`` and a schedule (GPipe, 1F1B, interleaved 1F1B) overlaps
their forward and backward passes across the stages, so fewer devices sit idle than in ``model_parallel``: the idle
fraction (bubble) is (S - 1) / (M + S - 1) for S stages and M micro-batches. When there are more ranks than one
pipeline needs, the rest is data parallel: the ranks form a (data_parallel x pipeline) mesh and each stage is
sharded with FSDP over its data-parallel group.

Lightning has no pipeline strategy; this one runs the schedule (forward and backward of every micro-batch
together) in place of Lightning's backward, and forward-only in ``validation_step``. Everything else (optimizers,
metrics, loggers, checkpoints) is Lightning's, unchanged.
"""

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from project.checkpoints import META_FILE, is_sharded_checkpoint
from project.parallel import apply_fsdp, block_sizes, split_blocks, stage_modules
from project.strategies.sharded import ShardedCheckpointStrategy

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}

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


def keep_only(model: nn.Module, kept: list[nn.Module]) -> None:
    """Free the stem, blocks and head this rank does not run; ``nn.Identity`` in their place keeps the names of
    the others (and so the checkpoint keys) unchanged."""
    kept_ids = {id(module) for module in kept}
    for index, block in enumerate(model.blocks):
        if id(block) not in kept_ids:
            model.blocks[index] = nn.Identity()
    for name in ("stem", "head"):
        if id(getattr(model, name)) not in kept_ids:
            setattr(model, name, nn.Identity())


class PipelineStrategy(ShardedCheckpointStrategy):
    """``num_stages`` stages over ``num_stages / stages_per_rank`` ranks per pipeline; batches must be ``(inputs, targets)``."""

    def __init__(
        self,
        num_stages: int,
        schedule: str = "1f1b",
        microbatches: int = 4,
        stages_per_rank: int = 1,
        blocks_per_stage: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.microbatches = microbatches
        self.stages_per_rank = stages_per_rank
        self.blocks_per_stage = list(blocks_per_stage) if blocks_per_stage is not None else None
        self.pipeline_size = num_stages // stages_per_rank
        self.stage_modules: list[StageModule] = []
        self._train_schedule = None
        self._eval_schedule = None
        self._eval_batch_size = 0
        self._batch: tuple[torch.Tensor, torch.Tensor] | None = None

    def setup_environment(self) -> None:
        # ModelParallelStrategy's setup with a (data_parallel, pipeline) mesh instead of (data, tensor) parallel.
        self._setup_distributed()
        data_parallel = self.world_size // self.pipeline_size
        self._device_mesh = init_device_mesh(
            self.root_device.type, (data_parallel, self.pipeline_size), mesh_dim_names=("data_parallel", "pipeline")
        )
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def stage_ids(self) -> list[int]:
        """This rank's stages: pipeline rank r runs stages r, r + P, r + 2P, ... (interleaved when several)."""
        rank = self.device_mesh["pipeline"].get_local_rank()
        return [rank + k * self.pipeline_size for k in range(self.stages_per_rank)]

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def parallelize(self, model: nn.Module) -> None:
        """Called from the LightningModule's ``configure_model`` with its plain model."""
        if self.stage_modules:
            return
        stages = split_blocks(block_sizes(model), self.num_stages, self.blocks_per_stage)
        self.stage_modules = [StageModule(stage_modules(model, stages, stage)) for stage in self.stage_ids]
        keep_only(model, [module for stage in self.stage_modules for module in stage.blocks])
        if self.device_mesh["data_parallel"].size() > 1:
            for stage_module in self.stage_modules:
                apply_fsdp(stage_module, self.device_mesh["data_parallel"])

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Each rank reads its own blocks and their optimizer state from a sharded checkpoint.

        Lightning's loader insists on DTensor parameters, which a pipeline without data parallelism does not have;
        and the optimizer's parameter groups differ per rank, so only their tensors are read back (the groups'
        hyperparameters come from the config, the LR schedule from Lightning's own state).
        """
        path = Path(self.broadcast(str(checkpoint_path)))
        if not is_sharded_checkpoint(path):
            raise ValueError(f"strategy=pipeline resumes from the sharded checkpoints it saves; {path} is not one")
        model_state = get_model_state_dict(self.model)
        dcp.load({"state_dict": model_state}, checkpoint_id=path)
        self.model.load_state_dict(model_state)
        for index, optimizer in enumerate(self.optimizers):
            optimizer_state = get_optimizer_state_dict(self.model, optimizer)
            dcp.load({f"optimizer_{index}": {"state": optimizer_state["state"]}}, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, optimizer_state)
        return torch.load(path / META_FILE, weights_only=weights_only)

    def _make_schedule(self, loss_fn) -> Any:
        stages = [
            PipelineStage(module, stage, self.num_stages, self.root_device, group=self.device_mesh["pipeline"].get_group())
            for module, stage in zip(self.stage_modules, self.stage_ids)
        ]
        schedule_class = SCHEDULES[self.schedule_name]
        stage_arg = stages if self.stages_per_rank > 1 else stages[0]  # the multi-stage schedules take a list
        return schedule_class(stage_arg, n_microbatches=self.microbatches, loss_fn=loss_fn)

    def _run_schedule(self, schedule, inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor | None:
        """Feed the inputs on the first stage; the last stage returns the merged outputs, other ranks None."""
        args = (inputs,) if self.holds_first_stage else ()
        return schedule(*args, **kwargs)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Only registers the metrics: Lightning zeroes gradients between ``training_step`` and ``backward``, so
        the schedule (forward and backward of every micro-batch) runs in ``backward``."""
        self._batch = batch
        self.lightning_module.log_metrics("train")
        return torch.zeros((), device=self.root_device)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        module = self.lightning_module
        if self._train_schedule is None:
            self._train_schedule = self._make_schedule(loss_fn=module.criterion)
        (inputs, target), self._batch = self._batch, None
        losses: list[torch.Tensor] = []
        logits = self._run_schedule(
            self._train_schedule.step, inputs, target=target if self.holds_last_stage else None, losses=losses
        )
        if self.holds_last_stage:
            # Equal micro-batches: the mean of their mean losses is the batch's mean loss (what the gradients used).
            module.update_metrics("train", logits, target, torch.stack(losses).mean())
        return closure_loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Forward only. Stages fix their activation shapes on first use, so every evaluation batch is padded to
        one size (the first, largest batch, rounded up to equal micro-batches) and the padding's outputs are dropped
        before the metrics see them."""
        module = self.lightning_module
        inputs, target = batch
        if self._eval_schedule is None:
            self._eval_schedule = self._make_schedule(loss_fn=None)
            self._eval_batch_size = -(-len(inputs) // self.microbatches) * self.microbatches
        size = len(inputs)
        padding = self._eval_batch_size - size
        if padding:
            inputs = torch.cat([inputs, inputs[:1].expand(padding, *inputs.shape[1:])])
        logits = self._run_schedule(self._eval_schedule.eval, inputs)
        if self.holds_last_stage:
            logits = logits[:size]
            module.update_metrics("val", logits, target, module.criterion(logits, target))
        module.log_metrics("val")
