"""What every task's LightningModule shares: the steps, the optimizer, and the protocol strategies rely on."""

from collections.abc import Callable, Sequence
from typing import cast

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torchmetrics import Metric

from project.checkpointing.hf import HFWeights, weights_fingerprint
from project.data.chat import IGNORE_INDEX
from project.models.float8 import (
    Float8Recipe,
    convert_to_float8,
    plain_weights,
    precompute_float8_scales,
    torchao_float8,
)
from project.models.lora import LoRA, apply_lora
from project.models.moe import MoE, auxiliary_loss, mixtures
from project.models.nf4 import is_nf4
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.options.option_types import Seed
from project.parallel.parallelize import (
    ActivationCheckpointing,
    apply_activation_checkpointing,
    checkpointing_mode,
    compile_blocks,
    materialize,
)
from project.strategies.laid_out import LaidOutStrategy
from project.tasks.metrics import ExpertLoad, SampleMean

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
        parameter.grad.to_local() if isinstance(parameter.grad, DTensor) else parameter.grad
        for group in optimizer.param_groups
        for parameter in group["params"]
        if parameter.grad is not None
    ]
    return torch.stack([torch.isfinite(grad).all() for grad in grads]).all() if grads else torch.tensor(True)


class TrainingModule(L.LightningModule):
    """Trains ``net`` (a plain model, ``head(blocks(stem(x)))``) on ``(inputs, targets)`` batches.

    ``net`` is normally built on the meta device; ``configure_model`` lets the strategy shard or split it, then
    materialises what this rank keeps, initialised from ``init_seed`` (``project.parallel.parallelize.materialize``).

    Subclasses set ``criterion`` (loss of a batch or micro-batch), ``train_metrics`` and ``val_metrics``
    (ModuleDicts of torchmetrics with a ``loss`` SampleMean, reduced across ranks once at epoch end) and may
    override ``update_task_metrics`` for the metrics beyond the loss. They give ``example_batch`` (a batch of the
    data's shapes, for the memory plan's simulated step).

    The protocol strategies use: ``configure_model`` hands ``net`` to ``strategy.parallelize`` (FSDP shards it,
    model/pipeline parallelism split it); a pipeline strategy runs the steps itself with ``criterion`` per
    micro-batch, feeds ``update_metrics`` where outputs exist and calls ``log_metrics`` on every rank; a strategy
    that returns a norm from ``clip_grad_norm_`` clips gradients by norm itself.
    """

    criterion: nn.Module
    train_metrics: nn.ModuleDict
    val_metrics: nn.ModuleDict
    example_batch: Callable[[int, DictConfig], tuple[torch.Tensor, torch.Tensor]]  # (batch_size, data config)

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
        lora: dict | None = None,
        float8: bool = False,
        float8_recipe: Float8Recipe = "tensorwise",
        float8_small_layers: bool = False,
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
        self.lora = None if lora is None else lora_settings(lora)
        if float8:
            _check_float8(self.lora)
        if self.lora is not None:
            _check_lora_targets(net, self.lora)
            apply_lora(net, self.lora)
            # Checkpoints hold the adapters alone: the frozen base is what configure_model gives every run of this
            # config (model.init_from's weights, or the seeded ones), so a resumed run rebuilds it, and its
            # checkpoints stay the adapters' size. Loading is then not strict: the base is not in the file.
            # (Every name of a tied weight: the output layer's too.)
            named = net.named_parameters(remove_duplicate=False)
            frozen = {f"net.{name}" for name, parameter in named if not parameter.requires_grad}
            self._register_state_dict_hook(_without(frozen))
            self.strict_loading = False
            # Every rank builds the same NF4 base (QLoRA). DDP's broadcast of the parameters when it wraps the module
            # would take it through full precision and quantize it again, moving its values.
            quantized = [f"net.{name}" for name, parameter in net.named_parameters() if is_nf4(parameter)]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self, quantized)
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
        self.float8_recipe = float8_recipe if float8 else None  # the blocks' matmuls in float8 (project.models.float8)
        self.float8_small_layers = float8_small_layers
        self.float8_layers: list[str] = []  # those converted, once prepare_net has
        self.gathers_in_float8 = False  # whether FSDP all-gathers their weights in float8
        # The training loss since the last step row (trainer.log_every_n_steps), reduced across ranks when logged.
        self.interval_loss = SampleMean()
        # A mixture of experts' routing over the epoch (the experts/* metrics), from every rank's mixtures.
        self.expert_load = ExpertLoad(net.num_layers, net.num_experts) if isinstance(net, MoE) else None
        self._configured = False
        self._logged_splits: set[str] = set()  # splits whose metrics Lightning holds for the epoch under way
        _check_optimizer(optimizer, self._optimizer_groups())  # on the meta-device parameters: nothing allocated

    def configure_model(self) -> None:
        if self._configured:
            return  # Lightning calls this again for validate or test after fit
        strategy = self.trainer.strategy
        dims = strategy.layout.dims(self.trainer.world_size) if isinstance(strategy, LaidOutStrategy) else None
        self.prepare_net(
            on_float8_gpus=strategy.root_device.type == "cuda",
            sharded=dims is not None and dims.shard and dims.data_parallel > 1,
        )
        if self.compile_each_block:
            compile_blocks(self.net)
        if isinstance(strategy, LaidOutStrategy):  # Lightning's own (DDP, one device) keep the whole model
            strategy.parallelize(self.net)
        weights = HFWeights(self.init_from) if self.init_from else None
        materialize(self.net, self.trainer.strategy.root_device, self.init_seed, weights)
        self._configured = True

    def prepare_net(self, on_float8_gpus: bool, sharded: bool) -> None:
        """What the model's own options do to the plain (meta) net before a layout acts, in torchtitan's order:
        its Linear layers to Float8 (``model.float8``: on float8 tensor cores ``on_float8_gpus``, else emulated;
        their weights all-gathered in float8 where FSDP shards them over data-parallel ranks, ``sharded``), then
        activation checkpointing. ``configure_model`` calls it, and the memory plan for the job it simulates."""
        if self.float8_recipe is not None:
            self.gathers_in_float8 = sharded and self.float8_recipe == "tensorwise"
            self.float8_layers = convert_to_float8(
                self.net,
                self.float8_recipe,
                emulate=not on_float8_gpus,
                gather_in_float8=self.gathers_in_float8,
                small_layers=self.float8_small_layers,
            )
        apply_activation_checkpointing(self.net, self.activation_checkpointing)

    def on_fit_start(self) -> None:
        """With Float8, say which layers it converted; with LoRA, say (and log, as hyperparameters) how much of the
        model trains."""
        if self.float8_recipe is not None:
            gathered = "; FSDP gathers their weights in float8" if self.gathers_in_float8 else ""
            small = "" if self.float8_small_layers else ", the small layers (model.float8_small_layers)"
            rank_zero_info(
                f"Float8 ({self.float8_recipe}): {len(self.float8_layers)} Linear layers of the blocks convert their "
                f"matmuls{gathered}. The embedding, output layer, routers{small} and layers of widths not in 16s "
                "keep the run's precision."
            )
        if self.lora is None:
            return
        share = self.trained_parameters / self.total_parameters
        frozen = "frozen, the blocks' Linear weights in 4-bit NF4" if self.lora.quantize_base else "frozen"
        rank_zero_info(
            f"LoRA (rank {self.lora.rank} on {', '.join(self.lora.targets)}): training {self.trained_parameters:,} "
            f"of {self.total_parameters:,} parameters ({share:.2%}); the rest {frozen}."
        )
        for logger in self.loggers:
            logger.log_hyperparams({"model/trained_parameters": self.trained_parameters, "model/trained_share": share})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def metrics_for(self, split: str) -> nn.ModuleDict:
        return self.train_metrics if split == "train" else self.val_metrics

    def update_metrics(self, split: str, outputs: torch.Tensor, target: torch.Tensor, loss: torch.Tensor) -> None:
        """Add a batch to ``split``'s metrics (train or val)."""
        metrics = self.metrics_for(split)
        # The loss is a sum over the trained targets divided by all the targets (TokenCrossEntropy): the sum, over
        # the trained targets, gives the epoch's mean over every trained sample (or token), whatever the batch
        # sizes and however many targets each batch leaves out (IGNORE_INDEX).
        total, trained = loss.detach() * target.numel(), (target != IGNORE_INDEX).sum()
        cast(SampleMean, metrics["loss"]).add(total, trained)
        # The step rows' loss, only when there are step rows. (Lightning's connectors set log_every_n_steps on the
        # Trainer; its class does not declare it.)
        if split == "train" and self.trainer.log_every_n_steps:  # type: ignore[attr-defined]
            self.interval_loss.add(total, trained)
        self.update_task_metrics(metrics, outputs.detach(), target)

    def update_task_metrics(self, metrics: nn.ModuleDict, outputs: torch.Tensor, target: torch.Tensor) -> None:
        """Metrics beyond the loss (none by default)."""

    def log_metrics(self, split: str) -> None:
        """Log ``split``'s metrics (train or val) for the epoch: hand Lightning the metric objects, once per epoch
        (or validation). Lightning computes them (reduced over ranks) at its end and resets them; every update in
        between goes into the objects themselves. Logging them at every step, as usual, costs Lightning's
        bookkeeping (some 1.7 ms a call here, more than a small model's step) and adds nothing."""
        if split in self._logged_splits:
            return
        self._logged_splits.add(split)
        metrics = self.metrics_for(split)
        self.log_dict(
            {f"{split}/{name}": cast(Metric, metric) for name, metric in metrics.items()},
            on_step=False,
            on_epoch=True,
            prog_bar=True,
        )

    def on_train_epoch_end(self) -> None:
        self._logged_splits.discard("train")

    def on_validation_epoch_end(self) -> None:
        self._logged_splits.discard("val")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Every ``trainer.log_every_n_steps`` optimizer steps (0: never), a row ``step/train_loss``: the mean
        training loss over those steps, all ranks' samples (or tokens) together, at x = ``step``. For runs measured
        in steps, and to compare runs step by step; the epoch rows are unchanged. Logged here, once the step's
        loss is known, rather than after the step, where a checkpoint of this step would be saved first. The
        mixtures' routing since the last step goes into the epoch's ``expert_load`` here too, for the same reason."""
        if self.expert_load is not None:
            held = mixtures(self.net)
            tallies = {layer: tally for layer, mixture in held.items() if (tally := mixture.take_tally()) is not None}
            self.expert_load.update(tallies)
            if any(mixture.bias_update_rate for mixture in held.values()):
                update_score_biases(held, tallies, self.expert_load.load)
        # (log_every_n_steps: set on the Trainer by Lightning's logger connector, not declared by its class.)
        every = self.trainer.log_every_n_steps  # type: ignore[attr-defined]
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
        if mid_epoch and self.expert_load is not None:
            epoch["expert_load"] = self.expert_load
        return {**epoch, "interval_loss": self.interval_loss}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """The training metrics so far, summed over ranks, so that an epoch resumed from a mid-epoch checkpoint
        reports the numbers of the whole epoch. Every rank saves (Lightning builds the checkpoint on each), so all
        join the reduction. (Under pipeline only the last stage updates them; the other stages add zeros.)"""
        trainer = self.trainer
        # The batch progress's trackers are _ProcessedTracker objects, declared as their base class by Lightning.
        processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
        mid_epoch = processed < trainer.num_training_batches
        if self.gathers_in_float8:
            checkpoint["state_dict"] = plain_weights(checkpoint["state_dict"])
        if self.lora is not None:  # what its adapters were trained on, which the checkpoint does not hold
            checkpoint["lora_base"] = lora_base(self.init_from, self.init_seed, self.lora.quantize_base)
        checkpoint["running_metrics"] = {}
        for key, metric in self._running_metrics(mid_epoch).items():
            with metric.sync_context():  # sums (the states' reductions) over ranks, then back to this rank's own
                checkpoint["running_metrics"][key] = {name: getattr(metric, name).clone() for name in metric._defaults}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Rank 0 takes the saved sums, the other ranks start from zero: their sum is the saved one. A LoRA
        checkpoint's adapters go on only on the base they were trained on (``check_lora_base``)."""
        if self.lora is not None:
            check_lora_base(checkpoint.get("lora_base"), self.init_from, self.init_seed, self.lora.quantize_base)
        for key, metric in self._running_metrics().items():
            metric.reset()
            saved = checkpoint.get("running_metrics", {}).get(key)
            if saved is not None and self.global_rank == 0:
                for name, value in saved.items():
                    setattr(metric, name, value.to(getattr(metric, name).device))
                metric._update_count = 1  # it holds updates: compute() without torchmetrics' warning

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The criterion's loss, plus a mixture's weighted balance loss (``model.net.load_balancing_weight``);
        ``train/loss`` is the criterion's alone, comparable with ``val/loss``."""
        inputs, target = batch
        outputs = self(inputs)
        loss = self.criterion(outputs, target)
        self.update_metrics("train", outputs, target, loss)
        self.log_metrics("train")
        balance = auxiliary_loss(self.net)
        return loss if balance is None else loss + balance

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        """After the epoch's last batch, a mixture's ``experts/*`` metrics (``ExpertLoad``), reduced over every
        rank: logged here, not at the epoch's end, where the job's result would already have taken the epoch."""
        trainer = self.trainer
        if self.expert_load is None:
            return
        # (The batch progress's trackers are _ProcessedTracker objects, declared as their base class by Lightning.)
        processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # type: ignore[attr-defined]
        epoch_ends = trainer.is_last_batch or processed >= trainer.num_training_batches
        if not (epoch_ends or trainer.should_stop or 0 < trainer.max_steps <= trainer.global_step):
            return
        # Equal on every rank once computed: sync_dist's max keeps them, where Lightning would warn otherwise.
        self.log_dict(self.expert_load.compute(), on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
        self.expert_load.reset()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, target = batch
        outputs = self(inputs)
        self.update_metrics("val", outputs, target, self.criterion(outputs, target))
        self.log_metrics("val")

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
            if not parameter.requires_grad:  # frozen (LoRA's base): no gradient, no optimizer state
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
        """The optimizer over the parameter groups, with what must follow each of its steps: the float8 scales of the
        next all-gathers, from the weights the step has just updated (``model.float8`` under FSDP)."""
        optimizer = self.optimizer_factory(params=self._optimizer_groups())
        if self.gathers_in_float8:
            optimizer.register_step_post_hook(lambda *_: precompute_float8_scales(self.net))
        return optimizer

    def configure_optimizers(self):
        optimizer = self.new_optimizer()
        if self.scheduler_factory is None:
            return optimizer
        # Per optimizer step, over this run's steps (epochs, devices, accumulation and max_steps included).
        scheduler = self.scheduler_factory(optimizer, run_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def update_score_biases(held: dict, tallies: dict, like: torch.Tensor) -> None:
    """Each held mixture's score bias moved after a step by its load: its assignments of this step on every rank
    (``tallies``: this rank's, by block index), summed over all ranks (a rank adds zeros for the blocks it does not
    hold, as a pipeline stage)."""
    load = torch.zeros_like(like)
    for layer, tally in tallies.items():
        load[layer] = tally.load
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(load)
    for layer, mixture in held.items():
        mixture.update_bias(load[layer])


def lora_base(init_from: str | None, init_seed: int, quantized: bool) -> str:
    """What a LoRA run's frozen base is: the fingerprint of ``model.init_from``'s weights, or the seed drawing it,
    and whether it is stored in NF4 (QLoRA's adapters learn to correct the quantized weights)."""
    base = f"weights {weights_fingerprint(init_from)}" if init_from else f"seed {init_seed}"
    return f"{base} in NF4" if quantized else base


def check_lora_base(saved: str | None, init_from: str | None, init_seed: int, quantized: bool) -> None:
    """``ConfigError`` when the base a LoRA checkpoint's adapters were trained on (``saved``) is not this one."""
    here = lora_base(init_from, init_seed, quantized)
    if saved is not None and saved != here:
        raise ConfigError(
            "model.init_from" if init_from else "seed",
            f"gives a base ({here}) other than the one the checkpoint's adapters were trained on ({saved}).",
            "use the model dir (or seed) and model.lora.quantize_base the run started from, unchanged: the "
            "checkpoint holds the adapters alone.",
        )


def _check_float8(lora: LoRA | None) -> None:
    """Float8 training needs torchao, and trains whole models: LoRA's layers are Linear subclasses of their own."""
    torchao_float8()
    if lora is not None:
        raise ConfigError(
            "model.float8",
            "is true with LoRA adapters (model.lora), which Float8 training does not convert.",
            "set model.float8=false to fine-tune with LoRA, or model.lora=null to train in Float8.",
        )


def _without(names: set[str]) -> Callable[..., None]:
    """A state-dict hook that leaves out the parameters ``names`` (under the module's own prefix)."""

    def hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        for name in names:
            state_dict.pop(prefix + name, None)

    return hook


def lora_settings(settings: dict) -> LoRA:
    """``model.lora``'s settings, checked: a positive integer rank and alpha, a dropout in [0, 1), some targets, and
    (optional, false by default) whether to quantize the base."""
    fields, optional = {"rank", "alpha", "dropout", "targets"}, {"quantize_base"}
    if not fields <= set(settings) <= fields | optional:
        raise ConfigError(
            "model.lora",
            f"has keys {sorted(settings)}.",
            f"give {sorted(fields)} (and optionally {sorted(optional)}), or model.lora=null.",
        )
    rank, alpha, dropout, targets = (settings[key] for key in ("rank", "alpha", "dropout", "targets"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ConfigError("model.lora.rank", f"is {rank!r}.", "give a positive integer, e.g. 8.")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise ConfigError("model.lora.alpha", f"is {alpha!r}.", "give a positive number, e.g. 16.")
    if not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise ConfigError("model.lora.dropout", f"is {dropout!r}.", "give a probability in [0, 1), e.g. 0.05.")
    if isinstance(targets, str) or not targets:
        raise ConfigError("model.lora.targets", f"is {targets!r}.", "give a list of layer names, e.g. [q, v].")
    quantize = settings.get("quantize_base", False)
    if not isinstance(quantize, bool):
        raise ConfigError(
            "model.lora.quantize_base", f"is {quantize!r}.", "give true (the base in 4-bit NF4: QLoRA) or false."
        )
    return LoRA(rank, float(alpha), float(dropout), tuple(targets), quantize)


def _check_lora_targets(net: BlockSequence, lora: LoRA) -> None:
    """Each of ``lora.targets`` names Linear layers of the net's blocks (of any: a mixture's dense first blocks and
    its later ones have other layers)."""
    linear = sorted(
        {name.rpartition(".")[2] for name, module in net.blocks.named_modules() if isinstance(module, nn.Linear)}
    )
    unknown = [target for target in lora.targets if target not in linear]
    if unknown:
        raise ConfigError(
            "model.lora.targets",
            f"names {unknown}, which are not Linear layers of {type(net).__name__}'s blocks.",
            f"choose among {linear}.",
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
