"""Checks of a composed config that run before any worker process or W&B run starts.

Each failure is a ``ConfigError`` whose message names the key, what is wrong and the fix, in one paragraph.
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
from project.parallel import block_sizes, split_blocks


def _positive_int(cfg: DictConfig, key: str, fix: str) -> int:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"must be a positive integer, got {value!r}.", fix)
    return value


def uses_cuda(cfg: DictConfig) -> bool:
    """Whether the trainer will run on CUDA devices (accelerator gpu/cuda, or auto with GPUs present)."""
    accelerator = str(cfg.trainer.accelerator)
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


# What Lightning's ModelParallelStrategy (fsdp, pipeline) accepts.
SHARDED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")


def strategy_shards_model(cfg: DictConfig) -> bool:
    """Whether the configured Lightning strategy is a ModelParallelStrategy (FSDP2): it saves and loads sharded
    checkpoints, and supports fewer precisions."""
    target = OmegaConf.select(cfg, "strategy._target_")
    return target is not None and issubclass(get_class(target), ModelParallelStrategy)


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


def _check_precision_and_offload(cfg: DictConfig) -> None:
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
    if precision not in SHARDED_PRECISIONS and strategy_shards_model(cfg):
        raise ConfigError(
            "trainer.precision",
            f"is {precision!r}, which Lightning's ModelParallelStrategy (under strategy=fsdp and pipeline) does not "
            "support.",
            f"use one of {', '.join(SHARDED_PRECISIONS)} (bf16-mixed: parameters are gathered and computed in bf16, "
            "gradients reduced in fp32).",
        )
    if OmegaConf.select(cfg, "strategy.cpu_offload") and not uses_cuda(cfg):
        raise ConfigError(
            "strategy.cpu_offload",
            "moves parameter shards from GPU to CPU memory, but this run has no GPU.",
            "set strategy.cpu_offload=false, or run on GPUs (trainer.accelerator=gpu).",
        )


def pipeline_ranks(cfg: DictConfig) -> int:
    """Ranks one pipeline spans (1 for strategies without a pipeline)."""
    stages_per_rank = OmegaConf.select(cfg, "strategy.stages_per_rank")
    return cfg.strategy.num_stages // stages_per_rank if stages_per_rank else 1


def data_parallel_size(cfg: DictConfig) -> int:
    """Replicas that split each global batch: every process, except that a pipeline's ranks share one."""
    return cfg.strategy.processes * cfg.trainer.num_nodes // pipeline_ranks(cfg)


def _check_pipeline(cfg: DictConfig) -> None:
    stages_per_rank = OmegaConf.select(cfg, "strategy.stages_per_rank")
    if stages_per_rank is None:
        return
    strategy = cfg.strategy
    key = "strategy."
    if stages_per_rank < 1 or strategy.num_stages % stages_per_rank:
        raise ConfigError(
            key + "stages_per_rank",
            f"is {stages_per_rank}, which does not divide the {strategy.num_stages} stages.",
            "use a divisor of strategy.num_stages (1 unless the schedule is interleaved_1f1b).",
        )
    schedule = strategy.schedule
    if schedule not in ("gpipe", "1f1b", "interleaved_1f1b"):
        raise ConfigError(key + "schedule", f"is {schedule!r}.", "use gpipe, 1f1b or interleaved_1f1b.")
    if (schedule == "interleaved_1f1b") != (stages_per_rank > 1):
        raise ConfigError(
            key + "stages_per_rank",
            f"is {stages_per_rank} with schedule {schedule}: interleaving means several stages per rank, the other "
            "schedules run one.",
            "use schedule=interleaved_1f1b with stages_per_rank >= 2, or stages_per_rank=1 with gpipe or 1f1b.",
        )
    ranks, processes = pipeline_ranks(cfg), cfg.strategy.processes * cfg.trainer.num_nodes
    if processes % ranks:
        raise ConfigError(
            "trainer.devices",
            f"gives {processes} processes, not a multiple of the {ranks} ranks one pipeline needs "
            f"({strategy.num_stages} stages / {stages_per_rank} per rank).",
            f"use a multiple of {ranks} devices (the factor beyond {ranks} is data parallel).",
        )
    microbatches, batch_size = strategy.microbatches, cfg.data.batch_size
    if microbatches < 1 or batch_size % microbatches:
        raise ConfigError(
            key + "microbatches",
            f"is {microbatches}, which does not divide data.batch_size={batch_size} into equal micro-batches.",
            f"choose microbatches dividing {batch_size}, or change data.batch_size.",
        )
    if schedule != "gpipe" and microbatches < ranks:
        raise ConfigError(
            key + "microbatches",
            f"is {microbatches}, fewer than the {ranks} pipeline ranks: {schedule} needs at least one micro-batch in "
            "flight per rank.",
            f"use strategy.microbatches={ranks} or more (a multiple of {ranks} for interleaved_1f1b).",
        )
    if schedule == "interleaved_1f1b" and microbatches % ranks:
        raise ConfigError(
            key + "microbatches",
            f"is {microbatches}; interleaved_1f1b runs micro-batches in rounds of {ranks} (the pipeline ranks).",
            f"use a multiple of {ranks}.",
        )


def _check_stage_split(cfg: DictConfig, net: torch.nn.Module) -> None:
    """Strategies that split the model into stages: the split must exist for this model."""
    if OmegaConf.select(cfg, "strategy.num_stages") is None:
        return
    num_stages = _positive_int(cfg, "strategy.num_stages", "set strategy.num_stages to the stages to split the model into.")
    if OmegaConf.select(cfg, "model.net.tie_weights"):
        raise ConfigError(
            "model.net.tie_weights",
            "ties the first stage's token embedding to the last stage's output layer, but stages on different "
            "devices would each train their own copy.",
            "set model.net.tie_weights=false for model_parallel and pipeline.",
        )
    blocks_per_stage = OmegaConf.select(cfg, "strategy.blocks_per_stage")
    try:
        split_blocks(block_sizes(net), num_stages, blocks_per_stage)
    except ValueError as error:
        key = "strategy.blocks_per_stage" if blocks_per_stage is not None else "strategy.num_stages"
        fix = (
            f"give {num_stages} positive counts that add up to {len(net.blocks)}, or blocks_per_stage=null to balance."
            if blocks_per_stage is not None
            else f"use at most {len(net.blocks)} stages (trainer.devices or strategy.num_stages), or a deeper model."
        )
        raise ConfigError(key, f"cannot split the model: {error}.", fix) from None


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
    if ckpt_path is not None and OmegaConf.select(cfg, "strategy.stages_per_rank") and not Path(ckpt_path).is_dir():
        raise ConfigError(
            "ckpt_path",
            f"{ckpt_path} is a single-file checkpoint; strategy=pipeline resumes only the sharded checkpoints it saves.",
            "resume it with the strategy that wrote it (or auto), or start the pipeline fresh with ckpt_path=null.",
        )


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
    devices = _positive_int(cfg, "trainer.devices", "set trainer.devices to the number of devices, e.g. trainer.devices=2.")
    _positive_int(cfg, "trainer.num_nodes", "set trainer.num_nodes=1 for a single machine.")
    batch_size = _positive_int(cfg, "data.batch_size", "set data.batch_size to the samples per device per step, e.g. data.batch_size=32.")
    _positive_int(cfg, "strategy.processes", "processes is one per device for data-parallel strategies: strategy.processes=${trainer.devices}.")

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

    _check_precision_and_offload(cfg)
    with torch.device("meta"):  # shapes only, nothing allocated
        net = _build(cfg, "model.net")
    _build(cfg, "model", net=net)  # the LightningModule checks its own options (optimizer groups, schedule)
    _check_stage_split(cfg, net)
    _check_pipeline(cfg)

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

    _check_checkpoint(cfg)
