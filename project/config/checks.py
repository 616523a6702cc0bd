"""Checks of a composed config that run before any worker process or W&B run starts.

Each failure is a ``ConfigError`` whose message names the key, what is wrong and the fix, in one paragraph. The
checks here hold for every run; every other rule is its owner's, asked from here: the data module's
(``DataModule.model_problem``, ``task_problem``), the task's (``TrainingModule.data_problem``), the job's
(``project.job.rules.layout_problem``: the layout's, each model option's, the task's own), and each callback's and
logger's (``ConfigRules``); the model and data modules check their options when they are built. What passes is the
run's typed ``Job``, built once (``project.config.build.build_job``).
"""

import json
import logging
import math
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from lightning.fabric.connector import _convert_precision_to_unified_args
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.strategies import SingleDeviceStrategy
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError
from torch import nn

from project.checkpointing.files import checkpoint_shapes
from project.checkpointing.hf import HFWeights, check_matches
from project.config.build import (
    build_job,
    build_strategy,
    configured_callbacks,
    layout_of,
    model_of,
    net_constructor,
    uses_cuda,
)
from project.config.schema import check_types
from project.data.datamodule import DataModule
from project.job.job import Job
from project.job.layout import Layout
from project.job.model_option import ModelOption
from project.job.rules import gpus_problem, is_int, layout_problem
from project.options.config_rules import ConfigRules
from project.options.errors import ConfigError, cannot_build, positive_int

log = logging.getLogger(__name__)


def positive_int_at(cfg: DictConfig, key: str, fix: str) -> int:
    """The value at ``key`` if it is a positive integer (``ConfigError`` otherwise)."""
    return positive_int(key, OmegaConf.select(cfg, key), fix)


def _check_numbers(cfg: DictConfig) -> None:
    """Types and ranges of the numbers a run is set up with (Hydra passes ``trainer.max_epochs=two`` on as text)."""
    if not is_int(cfg.seed) or not 0 <= cfg.seed < 2**32:
        raise ConfigError("seed", f"must be an integer from 0 to 2**32 - 1, got {cfg.seed!r}.", "e.g. seed=42.")
    if cfg.trainer.max_epochs != -1:
        positive_int_at(
            cfg,
            "trainer.max_epochs",
            "train at least one epoch, e.g. trainer.max_epochs=10 (or -1: no "
            "epoch limit, for runs that stop at trainer.max_steps or trainer.max_time).",
        )
    max_steps = cfg.trainer.get("max_steps", -1)
    if max_steps != -1:
        positive_int_at(
            cfg,
            "trainer.max_steps",
            "stop after N optimizer steps, e.g. trainer.max_steps=10000, or -1 for no step limit.",
        )
    elif cfg.trainer.max_epochs == -1 and cfg.trainer.get("max_time") is None:
        raise ConfigError(
            "trainer.max_epochs",
            "is -1 (no epoch limit) and trainer.max_steps is -1 too: the run would never end.",
            "set trainer.max_steps=N (optimizer steps), or trainer.max_epochs=N.",
        )
    positive_int_at(cfg, "trainer.accumulate_grad_batches", "1 steps the optimizer after every batch; N after every N.")
    log_every = cfg.trainer.log_every_n_steps
    if not is_int(log_every) or log_every < 0:
        raise ConfigError(
            "trainer.log_every_n_steps",
            f"must be an integer of at least 0, got {log_every!r}.",
            "0 logs per epoch only; N adds a step/train_loss row every N optimizer steps.",
        )
    if cfg.trainer.check_val_every_n_epoch is not None:
        positive_int_at(cfg, "trainer.check_val_every_n_epoch", "1 validates after every epoch.")
    sanity_steps = cfg.trainer.num_sanity_val_steps
    if not is_int(sanity_steps) or sanity_steps < -1:
        raise ConfigError(
            "trainer.num_sanity_val_steps",
            f"must be an integer of at least -1, got {sanity_steps!r}.",
            "0 skips the check, N runs N validation batches first, -1 all of them.",
        )
    for key in ("best_metric.mode", "optimized_metric.mode"):
        if OmegaConf.select(cfg, key) not in ("max", "min"):
            raise ConfigError(key, f"is {OmegaConf.select(cfg, key)!r}.", "use max (higher is better) or min.")
    also = OmegaConf.select(cfg, "optimized_metric.also", default=[])
    if not OmegaConf.is_list(also) and not isinstance(also, list) or not all(isinstance(name, str) for name in also):
        raise ConfigError(
            "optimized_metric.also", f"must be a list of metric names, got {also!r}.", "e.g. '[val/acc]', or []."
        )
    memory = cfg.get("memory_plan") or {}
    capacity = memory.get("device_memory_gb")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or capacity <= 0):
        raise ConfigError(
            "memory_plan.device_memory_gb",
            f"must be a positive number or null, got {capacity!r}.",
            "the memory of one device in GiB, e.g. memory_plan.device_memory_gb=80, or null: the GPU's.",
        )
    if memory.get("if_over") not in ("error", "warn"):
        raise ConfigError(
            "memory_plan.if_over",
            f"is {memory.get('if_over')!r}.",
            "use error (refuse a run predicted not to fit, before launch) or warn (train anyway).",
        )
    clip = cfg.trainer.gradient_clip_val
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip <= 0):
        raise ConfigError(
            "trainer.gradient_clip_val",
            f"must be a positive number or null, got {clip!r}.",
            "e.g. trainer.gradient_clip_val=1.0, or null for no clipping.",
        )


def _check_threads() -> None:
    """``OMP_NUM_THREADS``, where set, replaces the project's split of the cores between its processes: anything
    but a positive integer would be ignored by libgomp (with a warning of its own) and the split skipped."""
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads is not None and not (threads.strip().isdigit() and int(threads) > 0):
        raise ConfigError(
            "OMP_NUM_THREADS",
            f"is {threads!r} in the environment, not a number of threads.",
            "unset it (the project splits the cores between its processes), or set it to a positive integer.",
        )


def _check_accelerator(cfg: DictConfig) -> None:
    accelerator = str(cfg.trainer.accelerator)
    if accelerator in ("auto", "gpu"):
        return
    fix = "use trainer.accelerator=auto (GPUs where there are any), cpu or gpu."
    if accelerator not in AcceleratorRegistry:
        raise ConfigError("trainer.accelerator", f"is {accelerator!r}, which Lightning does not know.", fix)
    if not AcceleratorRegistry[accelerator]["accelerator"].is_available():  # a class method: nothing is built
        raise ConfigError("trainer.accelerator", f"is {accelerator!r}, which this machine does not have.", fix)


# The shortest collective timeout and hang watchdog timeout taken: ten of a worker's heartbeats (one a second,
# project.launch.processes), and more than a process group's start-up.
MIN_TIMEOUT_S = 10.0


def _check_process_group(cfg: DictConfig) -> None:
    """The strategy's process group and hang watchdog settings, where it has some (ddp, fsdp, pipeline...)."""
    backend = OmegaConf.select(cfg, "strategy.process_group_backend")
    if backend is not None:
        if backend not in dist.Backend.backend_list:
            raise ConfigError(
                "strategy.process_group_backend",
                f"is {backend!r}, not a torch.distributed backend.",
                "use null (nccl on GPUs, gloo on CPUs), nccl or gloo.",
            )
        if backend == "nccl" and not uses_cuda(cfg):
            raise ConfigError(
                "strategy.process_group_backend",
                "is 'nccl', which needs CUDA GPUs, but this run is on the CPU.",
                "use strategy.process_group_backend=gloo, or null to choose by device.",
            )
    heartbeat_timeout = OmegaConf.select(cfg, "strategy.heartbeat_timeout")
    if heartbeat_timeout is not None and (
        isinstance(heartbeat_timeout, bool)
        or not isinstance(heartbeat_timeout, (int, float))
        or not MIN_TIMEOUT_S <= heartbeat_timeout < math.inf
    ):
        raise ConfigError(
            "strategy.heartbeat_timeout",
            f"must be a number of seconds from {MIN_TIMEOUT_S:.0f} (ten of a worker's heartbeats, one a second: "
            f"less would fail healthy workers as stuck), or null, got {heartbeat_timeout!r}.",
            "e.g. strategy.heartbeat_timeout=60 (long enough for the slowest checkpoint or compile), or null for no "
            "hang watchdog.",
        )
    if OmegaConf.select(cfg, "strategy.timeout") is not None:
        try:
            timeout = instantiate(cfg.strategy.timeout)
        except InstantiationException as error:
            raise ConfigError(
                "strategy.timeout", f"cannot be built: {error.__cause__ or error}.", "e.g. strategy.timeout.minutes=5."
            ) from None
        if timeout.total_seconds() < MIN_TIMEOUT_S:
            raise ConfigError(
                "strategy.timeout",
                f"is {timeout}, under {MIN_TIMEOUT_S:.0f} s: the ranks' first collectives (joining the group, laying "
                "out the model) take longer than that, and each would fail.",
                "e.g. strategy.timeout.minutes=5.",
            )


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """``ckpt_path=last`` and ``auto`` mean this job dir's newest intact checkpoint: ``checkpoints/last.ckpt``, or,
    where it is missing or damaged, the newest other intact checkpoint beside it, with a warning. That is what a run
    killed while writing its first ``last.ckpt`` leaves (its ``epochNNN.ckpt`` is written first), and what a requeued
    job resumes. With no checkpoint there, ``auto`` is a fresh start and ``last`` is refused (``_check_checkpoint``);
    with checkpoints there but none intact, both are refused: a fresh start would write over them. Any other value
    is a file path."""
    if cfg.ckpt_path is None:
        return None
    if not str(cfg.ckpt_path).strip():  # ``ckpt_path=`` would be read as the working dir
        raise ConfigError(
            "ckpt_path",
            "is empty.",
            "give ckpt_path=null to start from scratch, auto or last to resume this job dir, or a checkpoint's path.",
        )
    if cfg.ckpt_path not in ("last", "auto"):
        return str(cfg.ckpt_path)
    checkpoints = checkpoints_dir(cfg)
    last = checkpoints / "last.ckpt"
    saved = _saved_checkpoints(checkpoints)
    if not saved:
        return None if cfg.ckpt_path == "auto" else str(last)
    for partial in sorted(checkpoints.glob("*.ckpt.partial")):
        log.warning(
            f"{partial} is a checkpoint whose write was cut short (the run stopped while saving it): it is left "
            "out, and the run resumes from the newest whole one."
        )
    damage = _damage(last) if last.exists() else "does not exist"
    if damage is None:
        return str(last)
    others = sorted((path for path in saved if path != last), key=lambda path: path.stat().st_mtime)
    intact = next((path for path in reversed(others) if _damage(path) is None), None)
    if intact is None:
        raise ConfigError(
            "ckpt_path",
            f"is {cfg.ckpt_path!r}, but {last} {damage}, and {checkpoints} holds no intact checkpoint.",
            "start afresh with ckpt_path=null (in another dir), or pass a checkpoint you "
            "have elsewhere as ckpt_path=<path>.",
        )
    log.warning(f"{last} {damage}: resuming from {intact}, the newest intact checkpoint of the job instead.")
    return str(intact)


def checkpoints_dir(cfg: DictConfig) -> Path:
    """Where the job's checkpoints go: the checkpoint callback's dir, by default ``<job dir>/checkpoints``."""
    dirpath = OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath")
    return Path(dirpath) if dirpath is not None else Path(cfg.paths.output_dir) / "checkpoints"


def _saved_checkpoints(checkpoints: Path) -> list[Path]:
    """The checkpoints in ``checkpoints`` (files, or sharded checkpoints' dirs), whole or not; a ``.partial``, which
    a write cut short leaves, is not one."""
    return sorted(checkpoints.glob("*.ckpt")) if checkpoints.is_dir() else []


def check_fresh_start(cfg: DictConfig) -> None:
    """A run that starts from scratch (``ckpt_path=null``) in a job dir that already holds checkpoints would write
    over them (the callback reuses their names): refused, naming the resume."""
    if cfg.ckpt_path is not None or cfg.mode != "train":
        return
    checkpoints = checkpoints_dir(cfg)
    saved = _saved_checkpoints(checkpoints)
    if saved:
        raise ConfigError(
            "ckpt_path",
            f"is null (start from scratch), but {checkpoints} holds checkpoints of an earlier run "
            f"({', '.join(path.name for path in saved)}), which this run would write over.",
            "resume them with ckpt_path=auto, or start in another dir (drop hydra.run.dir, or set it elsewhere).",
        )


def _damage(checkpoint: Path) -> str | None:
    """What is wrong with ``checkpoint`` if its index cannot be read, else None."""
    try:
        checkpoint_shapes(checkpoint)
    except (ValueError, RuntimeError, OSError, EOFError, pickle.UnpicklingError) as error:
        return str(error)
    return None


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
    if precision is None:  # Lightning reads null as 32-true; naming one beats guessing which the user meant
        raise ConfigError(
            "trainer.precision", "is null.", "set it: 32-true (Lightning's default), bf16-mixed or (on GPUs) 16-mixed."
        )
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


# The size most of a language model's weights are above (initialised at std 0.02, they stay near it).
_TYPICAL_WEIGHT = 0.01


def _warn_rounded_steps(cfg: DictConfig) -> None:
    """Warn where Adam's steps would round away in bfloat16 weights (``bf16-true``): a bfloat16 number has 8
    significant bits, so a step smaller than ``|w| x 2^-9`` leaves ``w`` as it was, and Adam's steps are about the
    learning rate in size (its first ones exactly). Legal, and almost surely not meant."""
    precision = _convert_precision_to_unified_args(cfg.trainer.precision)
    optimizer = OmegaConf.select(cfg, "model.optimizer")
    if precision != "bf16-true" or not isinstance(optimizer, DictConfig) or "lr" not in optimizer:
        return
    if str(optimizer.get("_target_", "")).rpartition(".")[2] not in ("Adam", "AdamW"):
        return
    lr = float(optimizer.lr)
    if lr * 2**9 >= _TYPICAL_WEIGHT:
        return
    log.warning(
        f"trainer.precision=bf16-true keeps the weights in bfloat16 (8 significant bits), where an Adam step of "
        f"about the learning rate (model.optimizer.lr={lr:g}) rounds away on every weight larger than "
        f"{lr * 2**9:.1e} in size: most of a language model's weights would not move. Use trainer.precision="
        f"bf16-mixed (float32 weights, bfloat16 matmuls), or a learning rate of {_TYPICAL_WEIGHT / 2**9:.0e} or more."
    )


def _check_checkpoint(cfg: DictConfig, module: nn.Module, ckpt_path: str | None) -> None:
    """``ckpt_path`` (resolved) exists and holds this model: the same parameter names and shapes."""
    if ckpt_path is None:
        return
    if not Path(ckpt_path).exists():
        hint = (
            "ckpt_path=last resumes the run dir given by hydra.run.dir=<that run's dir>; run with that override, "
            "or pass the checkpoint file itself as ckpt_path=<path>."
            if cfg.ckpt_path == "last"
            else "pass an existing checkpoint file (a run's checkpoints/*.ckpt), or ckpt_path=null to start fresh."
        )
        raise ConfigError("ckpt_path", f"{ckpt_path} does not exist.", hint)
    try:
        saved = checkpoint_shapes(ckpt_path)
    except (ValueError, RuntimeError, OSError, pickle.UnpicklingError) as error:
        raise ConfigError(
            "ckpt_path",
            f"{ckpt_path} {error}.",
            "pass a checkpoint a run of this project saved (checkpoints/*.ckpt in its job dir).",
        ) from None
    expected = {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}
    differences = (
        [f"{len(set(expected) - set(saved))} of this model's tensors missing"] if set(expected) - set(saved) else []
    )
    if set(saved) - set(expected):
        differences.append(f"{len(set(saved) - set(expected))} tensors this model lacks")
    differences += [
        f"{name} is {list(saved[name])} there, {list(shape)} here"
        for name, shape in expected.items()
        if name in saved and saved[name] != shape
    ][:3]
    if differences:
        raise ConfigError(
            "ckpt_path",
            f"{ckpt_path} is a checkpoint of another model: {'; '.join(differences)}.",
            "resume with the model settings it was saved with (its job dir's config.yaml), or pass a "
            "checkpoint of this model.",
        )


def _build(key: str, build: Callable[[], Any]) -> Any:
    """``build()`` the object of the config node at ``key`` as the workers will (through Hydra, or a constructor
    ``model_of`` took from it); a ``ConfigError`` it raises comes out as it is, any other error as a ``ConfigError``
    naming ``key``."""
    try:
        return build()
    except ConfigError:
        raise
    except Exception as error:
        cause = error.__cause__ if isinstance(error, InstantiationException) else error
        if isinstance(cause, ConfigError):
            raise cause from None
        raise cannot_build(key, f"{type(cause).__name__}: {cause}" if cause is not None else str(error)) from None


def check_not_adapters(cfg: DictConfig) -> None:
    """``model.init_from``: not a peft adapter dir (``adapter_config.json``, no ``config.json``), which holds LoRA
    adapters, not a model. Checked before the config is resolved: ``data.tokenizer`` defaults to ``model.init_from``,
    and resolving reads its tokenizer, which would be blamed for what is missing."""
    path = OmegaConf.select(cfg, "model.init_from", throw_on_resolution_failure=False)  # resolving reports its own
    adapters = Path(path) / "adapter_config.json" if isinstance(path, str) else None
    if adapters is None or not adapters.is_file() or (adapters.parent / "config.json").is_file():
        return
    try:
        base = json.loads(adapters.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    raise ConfigError(
        "model.init_from",
        f"{path} is a peft adapter dir (adapter_config.json): it holds LoRA adapters, not a model's weights.",
        "give the model dir the adapters were trained on as model.init_from"
        + (f" (its adapter_config.json names {base})" if base else "")
        + "; export merges a run's adapters into a model dir.",
    )


def _check_init_from(cfg: DictConfig, net: nn.Module) -> None:
    """``model.init_from``: a Hugging Face model dir of this model's family and shape, holding every tensor."""
    path = OmegaConf.select(cfg, "model.init_from")
    if path is None:
        return
    if not Path(path).is_dir():
        raise ConfigError(
            "model.init_from",
            f"{path} is not a directory.",
            "pass a Hugging Face model dir (config.json "
            "and *.safetensors, as save_pretrained writes it), or model.init_from=null.",
        )
    check_matches(path, net, cast(dict[str, Any], OmegaConf.to_container(cfg.model.net, resolve=True)))
    try:
        missing = HFWeights(path).missing(net)
    except (OSError, ValueError, SafetensorError) as error:
        raise ConfigError(
            "model.init_from",
            f"{path}: its safetensors cannot be read ({error}).",
            "pass a complete model dir (model.safetensors, or its shards and index).",
        ) from None
    if missing:
        raise ConfigError(
            "model.init_from",
            f"{path} lacks {len(missing)} of this model's tensors, e.g. {missing[0]}.",
            "pass the complete model dir.",
        )


def _check_mode(cfg: DictConfig) -> None:
    """``mode``: train, or eval of given weights, in a job dir of its own (not the training job's, whose result
    and config it would overwrite)."""
    mode = cfg.get("mode", "train")
    if mode not in ("train", "eval"):
        raise ConfigError("mode", f"is {mode!r}.", "use mode=train, or mode=eval to validate a checkpoint.")
    if mode != "eval":
        return
    if cfg.ckpt_path in ("last", "auto"):
        raise ConfigError(
            "ckpt_path",
            f"is {cfg.ckpt_path!r}, this job dir's own checkpoint, but mode=eval writes a job dir of its own.",
            "pass the checkpoint's path, e.g. ckpt_path=<run dir>/checkpoints/last.ckpt.",
        )
    if cfg.ckpt_path is None and OmegaConf.select(cfg, "model.init_from") is None:
        raise ConfigError(
            "mode",
            "is eval, but there are no weights to evaluate (ckpt_path and model.init_from are null).",
            "pass ckpt_path=<a checkpoint> or model.init_from=<a Hugging Face model dir>.",
        )


def _check_processes(cfg: DictConfig, strategy: Any, layout: Layout, devices: int) -> None:
    """``strategy.processes``, the workers the launcher starts per node: one per device for a strategy that runs a
    process per device (Lightning's ``ParallelStrategy``: ddp, fsdp, pipeline, tensor_parallel, and auto), one for
    a strategy that drives every device from one process (model_parallel)."""
    expected, processes = layout.processes_per_node(devices), cfg.strategy.processes
    if processes != expected:
        one_process = isinstance(strategy, SingleDeviceStrategy)
        what = "drives every device from one process" if one_process else "runs one process per device"
        name = OmegaConf.select(cfg, "choices.strategy", default=type(strategy).__name__)
        raise ConfigError(
            "strategy.processes",
            f"is {processes}, but strategy={name} {what}: it needs {expected} with trainer.devices={devices}.",
            "leave strategy.processes as the strategy's config file sets it (python train.py --cfg job shows it).",
        )


def check_config(cfg: DictConfig) -> Job:
    """Raise ``ConfigError`` for the first setting that cannot work; the checked job otherwise."""
    _check_mode(cfg)
    devices = positive_int_at(
        cfg, "trainer.devices", "set trainer.devices to the number of devices, e.g. trainer.devices=2."
    )
    positive_int_at(cfg, "trainer.num_nodes", "set trainer.num_nodes=1 for a single machine.")
    positive_int_at(
        cfg, "data.batch_size", "set data.batch_size to the samples per device per step, e.g. data.batch_size=32."
    )
    positive_int_at(
        cfg,
        "strategy.processes",
        "processes is one per device for data-parallel strategies: strategy.processes=${trainer.devices}.",
    )
    problem = gpus_problem(str(cfg.trainer.accelerator), uses_cuda(cfg), devices)
    if problem is not None:
        raise problem

    _check_numbers(cfg)
    _check_threads()
    _check_accelerator(cfg)
    _check_process_group(cfg)
    _check_precision(cfg)
    _warn_rounded_steps(cfg)
    check_types(cfg)  # every other option against its constructor's type hints, every number finite
    # The data first: the model takes sizes from it (vocabulary, sequence length), so its own keys are to blame.
    data = _build("data", lambda: instantiate(cfg.data))  # cheap: data is read or generated in setup()
    if not isinstance(data, DataModule):
        raise ConfigError(
            "data._target_",
            f"is {type(data).__name__}, not a data module of this project (project.data.datamodule.DataModule).",
            "use one of the data group's options (python train.py --help lists them), or derive yours from DataModule.",
        )
    data.check_files()  # a data module on files checks them now, not mid-epoch (data=shards)
    net_options = _build("model.net", lambda: net_constructor(cfg))  # the constructors and their options only
    model = _build("model", lambda: model_of(cfg, net_options))
    net, module = model.meta_model()
    for option in model.module.keywords.values():  # every configured option, those that are off too
        line = option.notice(net) if isinstance(option, ModelOption) else None
        if line is not None:
            log.warning(line)
    strategy = _build("strategy", lambda: build_strategy(cfg.strategy))  # checks its options; no process group yet
    layout = layout_of(strategy, cfg.strategy)
    _check_processes(cfg, strategy, layout, devices)
    ckpt_path = resolve_ckpt_path(cfg)
    _check_checkpoint(cfg, module, ckpt_path)
    _check_init_from(cfg, net)
    problem = data.model_problem(net, OmegaConf.select(cfg, "model.net.vocab_size")) or module.data_problem(
        data, ckpt_path, evaluating=cfg.get("mode") == "eval"
    )
    if problem is not None:
        raise problem
    job = build_job(cfg, layout, model, ckpt_path, data)
    if job.cluster is not None and job.devices > job.cluster.devices_per_node:
        raise ConfigError(
            "trainer.devices",
            f"is {job.devices}, more than the {job.cluster.devices_per_node} GPUs of one {job.cluster.name} node.",
            f"use trainer.devices={job.cluster.devices_per_node} and trainer.num_nodes for more.",
        )
    problem = layout_problem(job)
    if problem is not None:
        raise problem
    # Each callback and logger that declares rules checks its own options (of the data too).
    nodes = {f"callbacks.{name}": node for name, node in configured_callbacks(cfg).items()}
    nodes.update({f"logger.{name}": node for name, node in (cfg.logger or {}).items()})
    for key, node in nodes.items():
        target = get_class(node._target_)
        if issubclass(target, ConfigRules):
            target.check_run_config(cfg, key, data)
    return job
