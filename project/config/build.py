"""The objects a config names, built as the workers build them (the plain model on the meta device, the Lightning
strategy), and the typed ``Job`` of a config (``build_job``, ``model_of``). And the way back, from typed jobs to
what a user types: the job under another strategy option (``with_strategy``: its layout as that option's file sets
it), and the overrides that make a change the planner suggests (``overrides``): the planner's only dotted keys."""

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from hydra.utils import get_class, instantiate
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig, OmegaConf

from project.data.datamodule import DataModule
from project.job.cluster import Cluster
from project.job.job import Job, Model, SearchSettings, Setting, ValidationSchedule
from project.job.layout import Layout
from project.layouts.data_parallel_layout import DataParallelLayout
from project.observability.text_sample import TextSample
from project.options.errors import ConfigError
from project.parallel.parallelize import Checkpointing, checkpointing_mode
from project.strategies.laid_out import LaidOutStrategy

STRATEGY_OPTIONS = Path(__file__).resolve().parents[2] / "conf" / "strategy"


def build_net(cfg: DictConfig) -> torch.nn.Module:
    """The plain model on the meta device: shapes only, no memory. Each rank materialises only what it keeps,
    once the strategy has sharded or split it (``TrainingModule.configure_model``)."""
    with torch.device("meta"):
        return instantiate(cfg.model.net)


# The strategy group's options that the launcher reads, not the strategy class.
LAUNCHER_KEYS = ("processes", "heartbeat_timeout")


def build_strategy(strategy_cfg: DictConfig) -> Any:
    """The Lightning strategy of the ``strategy`` group: its ``_target_`` built with every option but the
    launcher's, or Lightning's own ``"auto"`` where the option names no class."""
    if "_target_" not in strategy_cfg:
        return "auto"
    keys = cast(list[str], [key for key in strategy_cfg if key not in LAUNCHER_KEYS])  # a group's keys are strings
    return instantiate(OmegaConf.masked_copy(strategy_cfg, keys))


def layout_of(strategy: Any, strategy_cfg: DictConfig) -> Layout:
    """The layout of ``strategy`` (a built one): its own, or for Lightning's auto and DDP every rank a data-parallel
    replica holding the whole model. Any other strategy is refused: nothing would say how its ranks divide."""
    if isinstance(strategy, LaidOutStrategy):
        return strategy.layout
    if strategy == "auto" or isinstance(strategy, DDPStrategy):
        return DataParallelLayout(gradient_as_bucket_view=bool(strategy_cfg.get("gradient_as_bucket_view")))
    raise ConfigError(
        "strategy._target_",
        f"is {type(strategy).__name__}, which this project cannot lay out: its checks and memory plan would not "
        "know how its ranks divide the model.",
        "choose a strategy option: strategy=auto, ddp, fsdp, tensor_parallel, pipeline or model_parallel.",
    )


def uses_cuda(cfg: DictConfig) -> bool:
    """Whether the trainer will run on CUDA devices (accelerator gpu/cuda, or auto with GPUs present)."""
    accelerator = str(cfg.trainer.accelerator)
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def net_constructor(cfg: DictConfig) -> functools.partial:
    """``model.net``'s class with its options (``cfg`` resolved), as a plain partial: no net is built."""
    return _without(instantiate(cfg.model.net, _partial_=True, _convert_="all"))


def model_of(cfg: DictConfig, net: functools.partial | None = None) -> Model:
    """The typed model of ``cfg`` (resolved): the net's constructor (``net``, or ``net_constructor``'s) and the task
    module's with the options the config gives them, built once (nested objects too: the optimizer's factory, the
    model options), and the net's depth, activation checkpointing and compilation apart, as the planner changes and
    reads them. No net is built."""
    net = net_constructor(cfg) if net is None else net
    module = instantiate(cfg.model, _partial_=True, _convert_="all", net=None)
    return Model(
        name=(cfg.get("choices") or {}).get("model", "?"),
        net=_without(net, "num_layers"),
        module=_without(module, "net", "activation_checkpointing", "compile"),
        num_layers=net.keywords.get("num_layers"),
        activation_checkpointing=checkpointing_mode(module.keywords.get("activation_checkpointing")),
        compile=bool(module.keywords.get("compile", False)),
    )


def _without(built: functools.partial, *names: str) -> functools.partial:
    """``built`` (a partial Hydra made) as a plain partial of the same callable, without the arguments ``names``, its
    arguments' partials plain too (the optimizer's factory): calling it, as the planner does for every layout it
    simulates, runs no Hydra code (Hydra's partials check each call against its target policy, which their making
    has passed)."""
    keywords = {name: _plain(value) for name, value in built.keywords.items() if name not in names}
    return functools.partial(built.func, *(_plain(argument) for argument in built.args), **keywords)


def _plain(value: Any) -> Any:
    return _without(value) if isinstance(value, functools.partial) else value


def build_job(cfg: DictConfig, layout: Layout, model: Model, ckpt_path: str | None, data: DataModule) -> Job:
    """The typed job of ``cfg`` (resolved), laid out as ``layout`` (its strategy's), training ``model``
    (``model_of``) on ``data`` (its batches' shapes and samples); ``ckpt_path`` resolved. The only place a config
    becomes a job: ``project.config.checks.check_config`` builds it once, and the planner changes it, never the
    config."""
    choices = cfg.get("choices") or {}
    _, module = model.meta_model()
    return Job(
        layout=layout,
        model=model,
        strategy_name=choices.get("strategy", "?"),
        devices=cfg.trainer.devices,
        nodes=cfg.trainer.num_nodes,
        batch_size=cfg.data.batch_size,
        accumulate=cfg.trainer.accumulate_grad_batches,
        # None only for trainer.precision=null, which the checks refuse first.
        precision=cast(str, _convert_precision_to_unified_args(cfg.trainer.precision)),
        accelerator=str(cfg.trainer.accelerator),
        uses_cuda=uses_cuda(cfg),
        data=module.step_shape(data.shape),
        generation=module.generation(data.shape),
        train_samples=data.num_train_samples,
        val_samples=data.num_val_samples,
        validation=ValidationSchedule(
            OmegaConf.select(cfg, "trainer.val_check_interval"),
            cfg.trainer.check_val_every_n_epoch,
            cfg.trainer.get("limit_train_batches"),
        ),
        text_sample_prompt=text_sample_prompt(cfg),
        ckpt_path=ckpt_path,
        cluster=None if cfg.get("cluster") is None else Cluster.of(cfg.cluster),
        device_memory_gb=cfg.memory_plan.device_memory_gb,
        if_over=cfg.memory_plan.if_over,
        step_checks=cfg.step_checks,
        search=SearchSettings(
            tuple(cfg.plan_search.strategies), cfg.plan_search.max_pipeline_ranks, cfg.plan_search.prune
        ),
        plan_cache=Path(cfg.paths.cache_dir) / "plan_cache",
    )


def configured_callbacks(cfg: DictConfig) -> dict[str, DictConfig]:
    """The ``callbacks`` group's entries by name, but those set to null (``callbacks.model_checkpoint=null`` turns
    one off, as ``~callbacks.model_checkpoint`` does)."""
    return {name: callback for name, callback in (cfg.callbacks or {}).items() if callback is not None}


def text_sample_prompt(cfg: DictConfig) -> str | None:
    """The key of a text sample's prompt (``TextSample``'s ``callbacks.<name>.prompt``), where one is set: it needs
    ranks that each run the whole model."""
    for name, callback in configured_callbacks(cfg).items():
        if issubclass(get_class(callback._target_), TextSample) and callback.get("prompt") is not None:
            return f"callbacks.{name}.prompt"
    return None


def with_strategy(job: Job, name: str) -> Job:
    """``job`` under the ``strategy`` group's option ``name``, its layout as the option's file sets it (of the job's
    devices: a file may take them, as a pipeline's stages do), the model's settings kept. Not checked:
    ``project.job.rules.layout_problem`` says whether it can run."""
    return replace(job, layout=strategy_option_layout(name, job.devices), strategy_name=name)


@functools.cache
def strategy_option_layout(name: str, devices: int) -> Layout:
    """The layout of the ``strategy`` group's option ``name`` as its file in ``conf/strategy`` sets it, resolved for
    ``devices`` per node; built once per option and device count (a search lays out dozens of jobs from one)."""
    option = OmegaConf.load(STRATEGY_OPTIONS / f"{name}.yaml")
    cfg = OmegaConf.create({"trainer": {"devices": devices}, "strategy": option})
    OmegaConf.resolve(cfg)
    return layout_of(build_strategy(cfg.strategy), cfg.strategy)


# Each setting a change can make, as a user types it: the planner's suggestions name them (``overrides``).
SETTING_KEYS = {
    Setting.STRATEGY: "strategy",
    Setting.NUM_STAGES: "strategy.num_stages",
    Setting.MICROBATCHES: "strategy.microbatches",
    Setting.SCHEDULE: "strategy.schedule",
    Setting.STAGES_PER_RANK: "strategy.stages_per_rank",
    Setting.TENSOR_PARALLEL_SIZE: "strategy.tensor_parallel_size",
    Setting.EXPERT_PARALLEL_SIZE: "strategy.expert_parallel_size",
    Setting.DEVICES: "trainer.devices",
    Setting.NODES: "trainer.num_nodes",
    Setting.BATCH_SIZE: "data.batch_size",
    Setting.ACCUMULATE: "trainer.accumulate_grad_batches",
    Setting.ACTIVATION_CHECKPOINTING: "model.activation_checkpointing",
}
# model.activation_checkpointing's values, by the mode each gives.
CHECKPOINTING_VALUES: dict[Checkpointing, str] = {"off": "false", "selective": "selective", "full": "true"}


def overrides(job: Job, settings: frozenset[Setting]) -> str:
    """The overrides, as a user types them, that set ``settings`` to ``job``'s values, in ``Setting``'s order."""
    values = {
        Setting.STRATEGY: job.strategy_name,
        Setting.DEVICES: job.devices,
        Setting.NODES: job.nodes,
        Setting.BATCH_SIZE: job.batch_size,
        Setting.ACCUMULATE: job.accumulate,
        Setting.ACTIVATION_CHECKPOINTING: CHECKPOINTING_VALUES[job.model.activation_checkpointing],
        **job.layout.setting_values(),
    }
    return " ".join(f"{SETTING_KEYS[setting]}={values[setting]}" for setting in Setting if setting in settings)
