"""The objects a config names, built as the workers build them (the plain model on the meta device, the Lightning
strategy), and the typed ``Job`` of a config (``build_job``), or of the same config with a few keys changed
(``changed_job``: the candidates the memory plan and ``plan=search`` try)."""

import functools
from pathlib import Path
from typing import Any, cast

import torch
from hydra.utils import instantiate
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig, OmegaConf, open_dict

from project.job.cluster import Cluster
from project.job.job import Job, Layout, SearchSettings
from project.layouts.data_parallel_layout import DataParallelLayout
from project.options.errors import ConfigError
from project.parallel.parallelize import checkpointing_mode
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


def build_job(cfg: DictConfig, layout: Layout, ckpt_path: str | None, train_samples: int, val_samples: int) -> Job:
    """The typed job of ``cfg`` (resolved), laid out as ``layout`` (its strategy's); ``ckpt_path`` resolved; the
    data's training and validation samples. ``project.config.checks.check_config`` builds the job of a checked
    config; ``changed_job`` those of the changes the planner tries, unchecked."""
    choices = cfg.get("choices") or {}
    return Job(
        cfg=cfg,
        layout=layout,
        model_name=choices.get("model", "?"),
        strategy_name=choices.get("strategy", "?"),
        devices=cfg.trainer.devices,
        nodes=cfg.trainer.num_nodes,
        batch_size=cfg.data.batch_size,
        accumulate=cfg.trainer.accumulate_grad_batches,
        # None only for trainer.precision=null, which the checks refuse first.
        precision=cast(str, _convert_precision_to_unified_args(cfg.trainer.precision)),
        uses_cuda=uses_cuda(cfg),
        activation_checkpointing=checkpointing_mode(
            cfg.model.get("activation_checkpointing") or OmegaConf.select(cfg, "strategy.activation_checkpointing")
        ),
        seq_length=cfg.data.get("seq_length"),
        num_layers=OmegaConf.select(cfg, "model.net.num_layers"),
        train_samples=train_samples,
        val_samples=val_samples,
        ckpt_path=ckpt_path,
        cluster=None if cfg.get("cluster") is None else Cluster.of(cfg.cluster),
        device_memory_gb=cfg.memory_plan.device_memory_gb,
        if_over=cfg.memory_plan.if_over,
        search=SearchSettings(
            tuple(cfg.plan_search.strategies), cfg.plan_search.max_pipeline_ranks, cfg.plan_search.prune
        ),
        plan_cache=Path(cfg.paths.cache_dir) / "plan_cache",
    )


def changed_job(job: Job, changes: dict[str, Any], strategy: str | None = None) -> Job:
    """``job`` with ``strategy`` replaced by that option of the ``strategy`` group, as its file in ``conf/strategy``
    sets it, and dotted keys set (of its layout, batch, devices or model; the data's samples stay the job's). Not
    checked: ``project.config.checks.layout_problem`` says whether the change can run."""
    container = cast(dict[str, Any], OmegaConf.to_container(job.cfg))  # a copy: the job's config stays as it is
    if strategy is not None:
        container["strategy"] = _strategy_option(strategy)
    cfg = OmegaConf.create(container)
    with open_dict(cfg):
        for key, value in changes.items():
            OmegaConf.update(cfg, key, value, force_add=True)
    OmegaConf.resolve(cfg)  # in place: a search builds dozens of these, and each new DictConfig is costly
    layout = layout_of(build_strategy(cfg.strategy), cfg.strategy)
    return build_job(cfg, layout, job.ckpt_path, job.train_samples, job.val_samples)


@functools.cache
def _strategy_option(name: str) -> dict[str, Any]:
    """The ``strategy`` group's option ``name``, as its file in ``conf/strategy`` sets it (unresolved)."""
    return cast(dict[str, Any], OmegaConf.to_container(OmegaConf.load(STRATEGY_OPTIONS / f"{name}.yaml")))
