"""Checks of a composed config that run before any worker process or W&B run starts.

Each failure is a ``ConfigError`` whose message names the key, what is wrong and the fix, in one paragraph. The
checks here hold for every run; each strategy of this project adds its own rules (``check_config`` on its class),
and the model and data modules check their options when they are built.
"""

from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf import DictConfig, OmegaConf

from project.errors import ConfigError


def positive_int(cfg: DictConfig, key: str, fix: str) -> int:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"must be a positive integer, got {value!r}.", fix)
    return value


def uses_cuda(cfg: DictConfig) -> bool:
    """Whether the trainer will run on CUDA devices (accelerator gpu/cuda, or auto with GPUs present)."""
    accelerator = str(cfg.trainer.accelerator)
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def strategy_shards_model(cfg: DictConfig) -> bool:
    """Whether the configured Lightning strategy is a ModelParallelStrategy (fsdp, pipeline): it saves and loads
    sharded checkpoints."""
    cls = strategy_class(cfg)
    return cls is not None and issubclass(cls, ModelParallelStrategy)


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """``ckpt_path=last`` means this job dir's ``checkpoints/last.ckpt``; any other value is a file path."""
    if cfg.ckpt_path is None:
        return None
    if cfg.ckpt_path == "last":
        return str(Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt")
    return str(cfg.ckpt_path)


def _gpus_support_bf16(devices: int) -> bool:
    """Whether the first ``devices`` GPUs compute in bfloat16 (compute capability 8.0, Ampere, or newer).

    Asked of the device properties, which opens no CUDA context: ``torch.cuda.is_bf16_supported()`` would put
    one on GPU 0 in the launcher and in every rank before it has chosen its own GPU.
    """
    return all(torch.cuda.get_device_capability(index) >= (8, 0) for index in range(devices))


def _check_precision(cfg: DictConfig) -> None:
    try:  # Lightning's own reading: 32 and "32" are "32-true", 16 is "16-mixed", "bf16" is "bf16-mixed"...
        precision = _convert_precision_to_unified_args(cfg.trainer.precision)
    except ValueError as error:
        raise ConfigError("trainer.precision", f"{error}.", "use 32-true, bf16-mixed or (on GPUs) 16-mixed.") from None
    if precision.startswith("16") and not uses_cuda(cfg):
        raise ConfigError(
            "trainer.precision",
            f"is {precision!r}, but float16 training needs a CUDA GPU and this run is on the CPU.",
            "use trainer.precision=bf16-mixed (CPUs support bfloat16) or 32-true.",
        )
    if precision.startswith("bf16") and uses_cuda(cfg) and not _gpus_support_bf16(cfg.trainer.devices):
        raise ConfigError(
            "trainer.precision",
            f"is {precision!r}, but this GPU has no bfloat16 support.",
            "use trainer.precision=16-mixed or 32-true.",
        )


def strategy_class(cfg: DictConfig) -> type | None:
    """The configured Lightning strategy class (None for ``auto``, where Lightning chooses)."""
    target = OmegaConf.select(cfg, "strategy._target_")
    return None if target is None else get_class(target)


def data_parallel_size(cfg: DictConfig) -> int:
    """Replicas that split each global batch: every process, unless the strategy says otherwise (a pipeline's
    ranks share one replica)."""
    replicas = getattr(strategy_class(cfg), "data_parallel_replicas", None)
    return replicas(cfg) if replicas is not None else cfg.strategy.processes * cfg.trainer.num_nodes


def _check_checkpoint(cfg: DictConfig) -> None:
    ckpt_path = resolve_ckpt_path(cfg)
    if ckpt_path is not None and not Path(ckpt_path).exists():
        hint = (
            "ckpt_path=last resumes the run dir given by hydra.run.dir=<that run's dir>; run with that override, "
            "or pass the checkpoint file itself as ckpt_path=<path>."
            if cfg.ckpt_path == "last"
            else "pass an existing checkpoint file (a run's checkpoints/*.ckpt), or ckpt_path=null to start fresh."
        )
        raise ConfigError("ckpt_path", f"{ckpt_path} does not exist.", hint)


def _build(cfg: DictConfig, key: str, **kwargs: Any) -> Any:
    """Instantiate the config node at ``key`` as the workers will; its own ``ConfigError`` comes out as it is."""
    try:
        return instantiate(OmegaConf.select(cfg, key), **kwargs)
    except InstantiationException as error:
        if isinstance(error.__cause__, ConfigError):
            raise error.__cause__ from None
        raise ConfigError(key, f"cannot be built: {error}", f"check {key}._target_ and its arguments.") from None


def check_config(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` for the first setting that cannot work."""
    devices = positive_int(cfg, "trainer.devices", "set trainer.devices to the number of devices, e.g. trainer.devices=2.")
    positive_int(cfg, "trainer.num_nodes", "set trainer.num_nodes=1 for a single machine.")
    batch_size = positive_int(cfg, "data.batch_size", "set data.batch_size to the samples per device per step, e.g. data.batch_size=32.")
    positive_int(cfg, "strategy.processes", "processes is one per device for data-parallel strategies: strategy.processes=${trainer.devices}.")

    if uses_cuda(cfg):
        available = torch.cuda.device_count()
        if available == 0:
            raise ConfigError(
                "trainer.accelerator",
                f"is {cfg.trainer.accelerator!r} but this machine has no CUDA GPU.",
                "use trainer.accelerator=cpu (or auto), or run on a machine with GPUs.",
            )
        if devices > available:
            raise ConfigError(
                "trainer.devices",
                f"asks for {devices} GPUs but this machine has {available}.",
                f"set trainer.devices={available} or fewer, or trainer.accelerator=cpu for CPU processes.",
            )

    _check_precision(cfg)
    _check_checkpoint(cfg)
    with torch.device("meta"):  # shapes only, nothing allocated
        net = _build(cfg, "model.net")
    _build(cfg, "model", net=net)  # the LightningModule checks its own options (optimizer groups, schedule)
    strategy_rules = getattr(strategy_class(cfg), "check_config", None)
    if strategy_rules is not None:  # each strategy of this project checks what it needs (its own module)
        strategy_rules(cfg, net)

    datamodule = _build(cfg, "data")  # cheap: data is read or generated in setup(), not here
    data_parallel = data_parallel_size(cfg)
    global_batch = batch_size * data_parallel
    if global_batch > datamodule.num_train_samples:
        raise ConfigError(
            "data.batch_size",
            f"gives a global batch of {batch_size} x {data_parallel} data-parallel replicas = {global_batch} samples, more than the "
            f"{datamodule.num_train_samples} training samples, so an epoch would have no full batch.",
            f"lower data.batch_size to at most {datamodule.num_train_samples // data_parallel}, or use more training data.",
        )

    if datamodule.num_val_samples < data_parallel:
        raise ConfigError(
            "data.num_val",
            f"gives {datamodule.num_val_samples} validation samples, fewer than the {data_parallel} data-parallel "
            "replicas that each need one.",
            f"use at least {data_parallel} validation samples, or fewer devices.",
        )
