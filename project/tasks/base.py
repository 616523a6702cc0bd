"""What every task's LightningModule shares: the steps, the optimizer, and the protocol strategies rely on."""

import copy
import dataclasses
import difflib
import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, cast

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchmetrics import Metric

from project.checkpointing.files import checkpoint_meta
from project.checkpointing.hf import HFWeights
from project.data.datamodule import DataModule, DataShape, trainer_data
from project.data.targets import IGNORE_INDEX
from project.job.job import Job
from project.job.model_option import InitialWeights, ModelOption, Target
from project.job.task import Generation, Loss, MetricSums, Precomputation
from project.model_options import CONFIG_KEYS, in_order
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.options.option_types import Seed
from project.parallel.local_tensors import local_tensor
from project.parallel.parallelize import (
    ActivationCheckpointing,
    apply_activation_checkpointing,
    checkpointing_mode,
    compile_blocks,
    materialize,
)
from project.strategies.laid_out import LaidOutStrategy
from project.tasks.metrics import SampleMean
from project.tasks.precomputation import checkpoint_problem, precomputed_values

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]

# Parameter kinds weight decay can spare (``no_weight_decay``): shrinking them towards 0 only hurts.
NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)
NO_DECAY_KINDS = {
    "bias": lambda name, module: name.endswith("bias"),
    "norm": lambda name, module: isinstance(module, NORMS),
    "embedding": lambda name, module: isinstance(module, nn.Embedding),
}


def local_gradients_finite(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Whether every gradient element this rank holds (its shards of DTensor gradients) is finite: a boolean
    tensor on the gradients' device, read without a device sync or a collective. Element by element, not by the
    norm, which can overflow a half-precision dtype while every element is finite."""
    grads = [
        local_tensor(parameter.grad)
        for group in optimizer.param_groups
        for parameter in group["params"]
        if parameter.grad is not None
    ]
    return torch.stack([torch.isfinite(grad).all() for grad in grads]).all() if grads else torch.tensor(True)


def loss_sums(value: torch.Tensor, target: torch.Tensor) -> MetricSums:
    """The epoch loss's share of a batch's ``value``, a sum over its trained targets divided by all its targets
    (``TokenCrossEntropy``; a classifier's mean): the sum, over the trained targets (not ``IGNORE_INDEX``), so that
    the epoch's value is the mean over every trained sample (or token), whatever the batch sizes and however many
    targets each batch leaves out."""
    return {"loss": (value.detach() * target.numel(), (target != IGNORE_INDEX).sum())}


class TrainingModule(L.LightningModule, ABC):
    """Trains ``net`` (a plain model, ``head(blocks(stem(x)))``) on its data's ``(inputs, target)`` batches.

    ``net`` is normally built on the meta device; ``configure_model`` lets the strategy shard or split it, then
    materialises what this rank keeps, initialised from ``init_seed`` (``project.parallel.parallelize.materialize``).

    A task (a subclass) declares one ``loss``: of the model's outputs and the batch's target, with its share of the
    epoch metrics (``Loss``), which every caller goes through: Lightning's steps here, a pipeline's micro-batches
    (the strategy runs the schedule and meters each), the memory plan's simulated step. It sets ``criterion`` (the
    value of each row, or of a batch), ``train_metrics`` and ``val_metrics`` (ModuleDicts of ``SampleMean`` with a
    ``loss``, reduced across ranks once at epoch end) and may declare what it computes of every sample before its
    first step (``precomputation``) and its rules (``problem``, ``data_problem``). This class does the rest: the
    metric bookkeeping (``meter``, ``log_metrics``), the optimizer, checkpoints, the precomputation's run.

    ``options`` are the model options (``model.<name>``, ``project.model_options``): each acts at its hooks of the
    ``ModelOption`` contract, in their declared order, where this module builds, prepares, trains and checkpoints.

    The protocol strategies use (``project.job.task.TaskModule``): ``configure_model`` hands ``net`` to
    ``strategy.parallelize`` (FSDP shards it, model/pipeline parallelism split it); a pipeline strategy runs the
    steps itself, calling ``loss`` and ``meter`` per micro-batch and ``log_metrics`` on every rank; a strategy that
    returns a norm from ``clip_grad_norm_`` clips gradients by norm itself.
    """

    criterion: nn.Module
    train_metrics: nn.ModuleDict
    val_metrics: nn.ModuleDict
    progress_bar_metrics: tuple[str, ...] | None = None  # the metrics the progress bar shows (None: all)
    sequences_per_sample: ClassVar[int] = 1  # the rows of a batch its loss reads as one sample (a pair's two)
    precomputation: ClassVar[Precomputation | None] = None  # what it computes of every sample before training

    def __init__(
        self,
        net: BlockSequence,
        optimizer: OptimizerFactory,
        init_seed: Seed,
        scheduler: SchedulerFactory | None = None,
        no_weight_decay: Sequence[str] = (),
        activation_checkpointing: ActivationCheckpointing = False,
        init_from: str | None = None,
        compile: bool = False,
        **options: ModelOption | None,
    ) -> None:
        super().__init__()
        unknown = set(no_weight_decay) - set(NO_DECAY_KINDS)
        if unknown:
            raise ConfigError(
                "model.no_weight_decay",
                f"names {sorted(unknown)}, which are not parameter kinds.",
                f"list kinds among {sorted(NO_DECAY_KINDS)}, or [] to decay every parameter.",
            )
        if scheduler is not None:
            _check_scheduler(scheduler)
        self.net = net
        _check_options(type(self), options)
        # The model options that are on (project.model_options), in their declared order, each a copy of its own: an
        # option keeps what it did to this module's net.
        self.options = [copy.deepcopy(option) for option in in_order(options.values())]
        for option in self.options:
            option.build(net)
        named = net.named_parameters(remove_duplicate=False)
        frozen_names = {f"net.{name}" for name, parameter in named if not parameter.requires_grad}
        if frozen_names:
            # Checkpoints hold the trained parameters alone: the frozen ones (a fine-tuned model's base) are what
            # configure_model gives every run of this config (model.init_from's weights, or the seeded ones), so a
            # resumed run rebuilds them, and its checkpoints stay small. Loading is then not strict: they are not in
            # the file. (Every name of a tied weight: the output layer's too.)
            self._register_state_dict_hook(_without(frozen_names))
            self.strict_loading = False
            # Every rank builds the same frozen weights. DDP's broadcast of the parameters when it wraps the module
            # would take a quantized one (an NF4 base) through full precision and quantize it again.
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self, sorted(frozen_names))
        # Counted here, on the whole model (a rank holds a shard or a stage once the strategy has acted).
        self.trained_parameters = sum(p.numel() for p in net.parameters() if p.requires_grad)
        self.total_parameters = sum(p.numel() for p in net.parameters())
        self.optimizer_factory = optimizer
        self.init_seed = init_seed
        self.gradients_finite: torch.Tensor | None = None  # this step's, when clipping (clip_gradients)
        self.scheduler_factory = scheduler
        self.no_weight_decay = list(no_weight_decay)
        self.activation_checkpointing = checkpointing_mode(activation_checkpointing)
        self.init_from = init_from  # a Hugging Face model dir whose weights replace the seeded ones
        self.compile_each_block = compile  # (not self.compile: that is nn.Module's own method)
        # The training loss since the last step row (trainer.log_every_n_steps), reduced across ranks when logged.
        self.interval_loss = SampleMean()
        # What the model options keep over an epoch, from every rank.
        self.option_metrics = nn.ModuleDict(
            {name: metric for option in self.options for name, metric in option.epoch_metrics().items()}
        )
        self.precomputed: torch.Tensor | None = None  # the precomputation's values, once computed or read
        self._configured = False
        self._logged_splits: set[str] = set()  # splits whose metrics Lightning holds for the epoch under way
        _check_optimizer(optimizer, self._optimizer_groups())  # on the meta-device parameters: nothing allocated

    @property
    def initial_weights(self) -> InitialWeights:
        return InitialWeights(self.init_from, self.init_seed)

    def configure_model(self) -> None:
        if self._configured:
            return  # Lightning calls this again for validate or test after fit
        strategy = self.trainer.strategy
        dims = strategy.layout.dims(self.trainer.world_size) if isinstance(strategy, LaidOutStrategy) else None
        sharded = dims is not None and dims.shard and dims.data_parallel > 1
        self.prepare_net(Target(cuda=strategy.root_device.type == "cuda", sharded=sharded))
        if self.compile_each_block:
            compile_blocks(self.net)
            self.compile_loss()
        if isinstance(strategy, LaidOutStrategy):  # Lightning's own (DDP, one device) keep the whole model
            strategy.parallelize(self.net)
        weights = HFWeights(self.init_from) if self.init_from else None
        materialize(self.net, self.trainer.strategy.root_device, self.init_seed, weights)
        self.keep_initial_weights()
        self._configured = True

    def keep_initial_weights(self) -> list[torch.Tensor]:
        """What the task keeps of the net's weights as they start (GRPO's reference with full weights): called once
        they are on this rank's device, each a shard where the layout shards, before a checkpoint's are loaded (a
        resumed run keeps the same); and by the memory plan on its fake ones. Returns the tensors kept: none here."""
        return []

    def prepare_net(self, target: Target) -> None:
        """What the model's own settings do to the plain (meta) net before a layout acts, in torchtitan's order: each
        model option's ``prepare``, then activation checkpointing (then come compile and the layout). Both
        ``configure_model`` and the memory plan, for the job it simulates, call it."""
        for option in self.options:
            option.prepare(self.net, target)
        apply_activation_checkpointing(self.net, self.activation_checkpointing)

    def on_fit_start(self) -> None:
        """Each model option's line, and with frozen parameters how much of the model trains, as hyperparameters."""
        for option in self.options:
            line = option.summary()
            if line is not None:
                rank_zero_info(line)
        if self.trained_parameters == self.total_parameters:
            return
        share = self.trained_parameters / self.total_parameters
        for logger in self.loggers:
            logger.log_hyperparams({"model/trained_parameters": self.trained_parameters, "model/trained_share": share})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def metrics_for(self, split: str) -> nn.ModuleDict:
        return self.train_metrics if split == "train" else self.val_metrics

    def net_outputs(self, last: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What ``last``, the last module a device runs (the whole net, or its last stage), makes of its input ``x``
        for ``loss``: its output. (A net that computes the loss itself takes ``target`` too: a language model's fused
        loss.)"""
        return last(x)

    @abstractmethod
    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> Loss:
        """The task's loss of the net's ``outputs`` against the batch's (or micro-batch's) ``target``, and its share
        of the epoch metrics."""

    def meter(self, split: str, loss: Loss) -> None:
        """Add a batch's (or micro-batch's) ``loss`` to ``split``'s metrics (train or val); a training one to the
        step rows' loss too."""
        metrics = self.metrics_for(split)
        sums = loss.metric_sums()
        for name, (total, count) in sums.items():
            cast(SampleMean, metrics[name]).add(total, count)
        if split == "train" and self._step_rows_every:  # the step rows' loss, only when there are step rows
            self.interval_loss.add(*sums["loss"])

    @property
    def _step_rows_every(self) -> int:
        """``trainer.log_every_n_steps``: the optimizer steps between step rows (0: none). (Set on the Trainer by
        Lightning's logger connector; its class does not declare it.)"""
        return self.trainer.log_every_n_steps  # type: ignore[attr-defined]

    @property
    def _batches_processed(self) -> int:
        """The training batches of the epoch under way processed so far. (The batch progress's trackers are
        _ProcessedTracker objects, declared as their base class by Lightning.)"""
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]

    def log_metrics(self, split: str) -> None:
        """Log ``split``'s metrics (train or val) for the epoch: hand Lightning the metric objects, once per epoch
        (or validation). Lightning computes them (reduced over ranks) at its end and resets them; every update in
        between goes into the objects themselves. Logging them at every step, as usual, costs Lightning's
        bookkeeping (some 1.7 ms a call here, more than a small model's step) and adds nothing."""
        if split in self._logged_splits:
            return
        self._logged_splits.add(split)
        shown = self.progress_bar_metrics
        for on_bar in (True, False):
            metrics = {
                f"{split}/{name}": cast(Metric, metric)
                for name, metric in self.metrics_for(split).items()
                if (shown is None or name in shown) == on_bar
            }
            if metrics:  # batch_size: unused by metric objects; given, Lightning does not guess it from the batch
                self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=on_bar, batch_size=1)

    def on_train_epoch_end(self) -> None:
        self._logged_splits.discard("train")

    def on_validation_epoch_end(self) -> None:
        self._logged_splits.discard("val")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Every ``trainer.log_every_n_steps`` optimizer steps (0: never), a row ``step/train_loss``: the mean
        training loss over those steps, all ranks' samples (or tokens) together, at x = ``step``. For runs measured
        in steps, and to compare runs step by step; the epoch rows are unchanged. Logged here, once the step's
        loss is known, rather than after the step, where a checkpoint of this step would be saved first. Each model
        option's ``before_optimizer_step`` first."""
        for option in self.options:
            option.before_optimizer_step(self.net)
        every = self._step_rows_every
        step = self.trainer.global_step + 1  # the step about to be taken
        if not every or step % every:
            return
        loss = self.interval_loss.compute().item()  # every rank joins the reduction
        self.interval_loss.reset()
        for logger in self.loggers:
            logger.log_metrics({"step/train_loss": loss, "epoch": self.current_epoch}, step=step)

    def _running_metrics(self, mid_epoch: bool = True) -> dict[str, Metric]:
        """The metrics a resumed run must go on from: the step rows' always, the epoch's while it is under way."""
        epoch = (
            {f"train/{name}": cast(Metric, metric) for name, metric in self.train_metrics.items()} if mid_epoch else {}
        )
        if mid_epoch:
            epoch.update(cast(dict[str, Metric], dict(self.option_metrics.items())))
        return {**epoch, "interval_loss": self.interval_loss}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The training metrics so far, summed over ranks, so that an epoch resumed from a mid-epoch checkpoint
        reports the numbers of the whole epoch; and the precomputation's values with the fingerprint of their data.
        Every rank saves (Lightning builds the checkpoint on each), so all join the reduction. (Under pipeline only
        the last stage updates them; the other stages add zeros.)"""
        trainer = self.trainer
        mid_epoch = self._batches_processed < trainer.num_training_batches
        for option in self.options:
            option.on_save_checkpoint(checkpoint, self.initial_weights)
        if self.precomputation is not None:
            assert self.precomputed is not None, "computed once training has started"
            checkpoint[self.precomputation.checkpoint_key] = self.precomputed.cpu()
            checkpoint[self.precomputation.fingerprint_key] = trainer_data(self.trainer).fingerprint()
        checkpoint["running_metrics"] = {}
        for key, metric in self._running_metrics(mid_epoch).items():
            with metric.sync_context():  # sums (the states' reductions) over ranks, then back to this rank's own
                checkpoint["running_metrics"][key] = {name: getattr(metric, name).clone() for name in metric._defaults}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Rank 0 takes the saved sums, the other ranks start from zero: their sum is the saved one. Each model
        option checks the checkpoint first; a precomputation's values are taken if they are of this run's data."""
        for option in self.options:
            option.on_load_checkpoint(checkpoint, self.initial_weights)
        precomputation = self.precomputation
        if precomputation is not None and precomputation.checkpoint_key in checkpoint:
            problem = checkpoint_problem(precomputation, checkpoint, trainer_data(self.trainer))
            if problem is not None:  # checked before launch too; here for a checkpoint read by other means
                raise problem
            self.precomputed = checkpoint[precomputation.checkpoint_key]
        for key, metric in self._running_metrics().items():
            metric.reset()
            saved = checkpoint.get("running_metrics", {}).get(key)
            if saved is not None and self.global_rank == 0:
                for name, value in saved.items():
                    setattr(metric, name, value.to(getattr(metric, name).device))
                metric._update_count = 1  # it holds updates: compute() without torchmetrics' warning

    def compile_loss(self) -> None:
        """Compile the loss with the blocks (``model.compile``), in ``compiled_loss_module``: a subclass's business."""

    def compiled_loss_module(self) -> nn.Module | None:
        """The module whose forward (and backward) holds the loss ``compile_loss`` compiles, or None: none."""
        return None

    def problem(self, job: Job) -> ConfigError | None:
        """The first of the task's own rules that ``job`` breaks (how its devices divide the work), or None: asked
        with the layout's of every job and every layout the planner tries."""
        return None

    def step_shape(self, shape: DataShape) -> DataShape:
        """The shapes of the rows a training step runs forward and backward, of batches of the data's ``shape``:
        the data's own, but where the task makes rows of its own (GRPO's completions)."""
        return shape

    def generation(self, shape: DataShape) -> Generation | None:
        """What the task draws from the model inside each step, of batches of ``shape`` (None: nothing)."""
        return None

    def data_problem(self, data: DataModule, ckpt_path: str | None, evaluating: bool) -> ConfigError | None:
        """The first of the task's rules on the data it trains on and the checkpoint it starts from (``ckpt_path``;
        ``evaluating``: ``mode=eval``) that the run breaks, or None: the data's own rule on the task, and a
        precomputation's values in the checkpoint, which must be of this data's samples. Checked before launch."""
        problem = data.task_problem(type(self).__name__, self.sequences_per_sample)
        if problem is not None or self.precomputation is None or ckpt_path is None:
            return problem
        return checkpoint_problem(self.precomputation, checkpoint_meta(ckpt_path), data)

    def precomputed_of(self, samples: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The precomputation's values of ``samples`` (their indices), on ``device``."""
        assert self.precomputed is not None, "computed when training starts, or read from the checkpoint"
        return self.precomputed[samples.to(self.precomputed.device)].to(device)

    # At the first of the sanity check's validation and training (mode=eval reads it from the checkpoint): after
    # Lightning has read a checkpoint, which sharded strategies do only after on_fit_start.
    def on_train_start(self) -> None:
        self._precompute()

    def on_validation_start(self) -> None:
        self._precompute()

    def _precompute(self) -> None:
        """The precomputation's values on this rank's device: those the checkpoint held (its net no longer the one
        they are of), or else computed now."""
        precomputation = self.precomputation
        if precomputation is None:
            return
        if self.precomputed is not None:
            self.precomputed = self.precomputed.to(self.device)
            return
        start = time.perf_counter()
        # Outside the inference mode Lightning validates in: the values serve training steps too.
        with torch.inference_mode(False):
            self.precomputed = precomputed_values(self.trainer, self.net, self.criterion, self.device)
        rank_zero_info(
            f"{precomputation.task} {precomputation.name}: the {precomputation.values} of all "
            f"{len(self.precomputed)} {precomputation.sample}s under the model before its first step, computed in "
            f"{time.perf_counter() - start:.1f} s (kept in the checkpoints)."
        )

    def _step(self, split: str, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Lightning's step of ``split`` (train or val): the batch's loss, metered."""
        inputs, target = batch
        loss = self.loss(self.net_outputs(self.net, inputs, target), target)
        self.meter(split, loss)
        self.log_metrics(split)
        return loss.value

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The batch's loss, plus the model options' terms; ``train/loss`` is the task's alone, comparable with
        ``val/loss``."""
        loss = self._step("train", batch)
        for option in self.options:
            term = option.training_loss(self.net)
            if term is not None:
                loss = loss + term
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        """After the epoch's last batch, the model options' epoch metrics, reduced over every rank: logged here, not
        at the epoch's end, where the job's result would already have taken the epoch."""
        trainer = self.trainer
        if not self.option_metrics:
            return
        epoch_ends = trainer.is_last_batch or self._batches_processed >= trainer.num_training_batches
        if not (epoch_ends or trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step):
            return
        for metric in cast(dict[str, Metric], self.option_metrics).values():
            # Equal on every rank once computed: sync_dist's max keeps them, where Lightning would warn otherwise.
            self.log_dict(metric.compute(), on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
            metric.reset()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step("val", batch)

    def clip_gradients(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Lightning's clipping, except that by norm a strategy whose ranks each hold a part of the model (a
        pipeline stage) clips by the whole model's norm with its ``clip_grad_norm_``.

        First it notes whether this rank's gradients are finite (``gradients_finite``), which ``StopTogether``
        agrees on across the ranks after the step: clipped by a non-finite norm, every gradient turns NaN, and every
        parameter after the step, while this step's loss is still finite. Not under a gradient scaler
        (``16-mixed``): it skips the steps whose gradients overflow, as it should early in training."""
        if gradient_clip_val and getattr(self.trainer.precision_plugin, "scaler", None) is None:
            self.gradients_finite = local_gradients_finite(optimizer)
        strategy = self.trainer.strategy
        algorithm = gradient_clip_algorithm or self.trainer.gradient_clip_algorithm or "norm"
        if isinstance(strategy, LaidOutStrategy) and gradient_clip_val and algorithm == "norm":
            parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
            if strategy.clip_grad_norm_(parameters, gradient_clip_val) is not None:
                return  # clipped by the strategy, over the whole model
        super().clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def parameter_groups(self) -> list[list[str]]:
        """Names of the trained parameters in each optimizer group, in order: weight-decayed, then spared (the
        ``no_weight_decay`` kinds). Every rank has both groups, possibly empty, so their indices always agree."""
        decayed: list[str] = []
        spared: list[str] = []
        for name, parameter in self.named_parameters():
            if not parameter.requires_grad:  # frozen (a fine-tuned model's base): no gradient, no optimizer state
                continue
            module = self.get_submodule(name.rpartition(".")[0])
            spare = any(NO_DECAY_KINDS[kind](name, module) for kind in self.no_weight_decay)
            (spared if spare else decayed).append(name)
        return [decayed, spared]

    def _optimizer_groups(self) -> list[dict]:
        parameters = dict(self.named_parameters())
        decayed, spared = ([parameters[name] for name in group] for group in self.parameter_groups())
        return [{"params": decayed}, {"params": spared, "weight_decay": 0.0}]

    def new_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the parameter groups, with what the model options do after each of its steps."""
        optimizer = self.optimizer_factory(params=self._optimizer_groups())
        if self.options:
            optimizer.register_step_post_hook(lambda *_: self.after_weights_change())
        return optimizer

    def after_weights_change(self) -> None:
        """Each model option's ``after_weights_change``: after an optimizer step, or a task's exchange of weights."""
        for option in self.options:
            option.after_weights_change(self.net)

    def configure_optimizers(self):
        optimizer = self.new_optimizer()
        if self.scheduler_factory is None:
            return optimizer
        # Per optimizer step, over this run's steps (epochs, devices, accumulation and max_steps included).
        scheduler = self.scheduler_factory(optimizer, run_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _without(names: set[str]) -> Callable[..., None]:
    """A state-dict hook that leaves out the parameters ``names`` (under the module's own prefix)."""

    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        for name in names:
            state_dict.pop(prefix + name, None)

    return hook


def _check_options(module: type, options: Mapping[str, object]) -> None:
    """Each key beyond the constructor's own is a model option (``model.<name>``, a ``_target_`` node), or null: a
    misspelt key (``+model.compil=true``, ``model.lorra.rank=8``) is refused, naming the nearest there is."""
    for name, value in options.items():
        if value is None or isinstance(value, ModelOption):
            continue
        option = CONFIG_KEYS.get(name)
        if option is not None:  # the option's node replaced by a value (``model.float8=true``)
            keys = [field.name for field in dataclasses.fields(option) if field.init]  # type: ignore[arg-type]
            raise ConfigError(
                f"model.{name}",
                f"is {str(value).lower() if isinstance(value, bool) else repr(value)}, where the node of the model "
                f"option {option.__name__} goes.",
                f"set its keys instead: model.{name}.<key>=..., with <key> one of {', '.join(keys)}.",
            )
        known = [key for key in inspect.signature(TrainingModule).parameters if key != "options"]
        close = difflib.get_close_matches(name, known + list(options), n=2)
        meant = next((key for key in close if key != name), None)
        raise ConfigError(
            f"model.{name}",
            f"is neither an option of {module.__name__} nor a model option (a node with a _target_).",
            f"did you mean model.{meant}?" if meant else "remove it (python train.py --cfg job shows model's keys).",
        )


# How torch.optim's own errors name each hyperparameter, to point at the config key.
OPTIMIZER_ARGUMENTS = {
    "lr": "learning rate",
    "eps": "epsilon",
    "betas": "beta",
    "weight_decay": "weight_decay",
    "momentum": "momentum",
    "dampening": "dampening",
}


def _check_optimizer(factory: OptimizerFactory, groups: list[dict]) -> None:
    """Build the optimizer once, so that torch.optim checks its hyperparameters (a negative learning rate, betas
    outside [0, 1)...) before any worker starts; its message names the config key."""
    for name, value in getattr(factory, "keywords", {}).items():
        values = value if name == "betas" and isinstance(value, Sequence) and not isinstance(value, str) else [value]
        if name in OPTIMIZER_ARGUMENTS and not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
        ):
            raise ConfigError(
                f"model.optimizer.{name}",
                f"must be {'numbers' if name == 'betas' else 'a number'}, got {value!r}.",
                f"e.g. model.optimizer.{name}={'[0.9,0.95]' if name == 'betas' else 0.001}.",
            )
    try:
        factory(params=groups)
    except (ValueError, TypeError) as error:
        key = next(
            (f"model.optimizer.{name}" for name, words in OPTIMIZER_ARGUMENTS.items() if words in str(error)),
            "model.optimizer",
        )
        raise ConfigError(
            key, f"is refused by the optimizer: {error}.", f"set {key} to a value the optimizer accepts."
        ) from None


def _check_scheduler(factory: SchedulerFactory) -> None:
    """Build the schedule once on a stand-in optimizer, so a bad scheduler config fails before any training starts."""
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        factory(stand_in, run_steps=100)
    except TypeError as error:
        raise ConfigError(
            "model.scheduler",
            f"cannot be built as factory(optimizer, run_steps=...): {error}.",
            "use a schedule taking the run's optimizer steps, e.g. project.tasks.schedules.warmup_cosine, or null.",
        ) from None
