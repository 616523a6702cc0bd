"""Bad input to a command-line tool, answered as ``train.py`` answers a bad config: one paragraph naming the
argument, the problem and the fix, exit code 1, no traceback. Each tool checks its arguments before it writes
anything, so a refused command leaves nothing half-written.

The error is ``ConfigError`` (its key the argument: ``--out``, ``checkpoint``), the same one ``train.py`` prints.
"""

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import yaml
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from project.checkpointing.files import checkpoint_meta, checkpoint_shapes, job_config, job_config_file, model_state
from project.checkpointing.hf import HFWeights
from project.job.model_option import InitialWeights
from project.model_options import LoRAFineTuning
from project.models.lora import merged
from project.models.nf4 import dequantized
from project.options.errors import ConfigError, WriteFailed
from project.parallel.parallelize import materialize


def run_cli(prog: str, main: Callable[[], None]) -> None:
    """``main()``, with a ``ConfigError`` it raises printed as ``<prog>: <argument>: <problem> Fix: <fix>``, and a
    file it could not write (``WriteFailed``: a full disk) as ``<prog>: Could not write <what> <path>: ...``."""
    try:
        main()
    except (ConfigError, WriteFailed) as error:
        sys.exit(f"{prog}: {error}")


def existing_path(argument: str, path: str | Path, what: str) -> Path:
    """``path`` if it exists, else ``ConfigError`` naming ``argument`` (``what`` it should be)."""
    if not Path(path).exists():
        raise ConfigError(argument, f"{path} does not exist.", f"give the path of {what}.")
    return Path(path)


def checkpoint_and_config(checkpoint: str, config: str | None) -> DictConfig:
    """A checkpoint argument that is one (a file or sharded dir a run saved), and its job's config: ``--config``,
    or the ``config.yaml`` of the job dir the checkpoint sits in."""
    fix = "give a checkpoint a run saved: <job dir>/checkpoints/last.ckpt (a file, or a dir under fsdp and pipeline)."
    existing_path("checkpoint", checkpoint, "a checkpoint: <job dir>/checkpoints/last.ckpt")
    try:
        checkpoint_shapes(checkpoint)
    except (ValueError, RuntimeError, OSError, EOFError) as error:
        raise ConfigError("checkpoint", f"{checkpoint} {str(error).rstrip('.')}.", fix) from None
    if config is not None:
        existing_path("--config", config, "the config.yaml of the job that saved the checkpoint")
    elif not job_config_file(checkpoint).is_file():
        raise ConfigError(
            "--config",
            f"is not given, and {job_config_file(checkpoint)} (the job dir's, beside checkpoints/) does not exist.",
            "pass the config of the job that saved the checkpoint: --config <job dir>/config.yaml.",
        )
    try:
        return job_config(checkpoint, config)
    except yaml.YAMLError as error:
        raise ConfigError(
            "--config",
            f"{job_config_file(checkpoint, config)} is not YAML: {str(error).splitlines()[0]}",
            "pass the config.yaml of the job that saved the checkpoint.",
        ) from None


def trained_lora(cfg: DictConfig) -> LoRAFineTuning | None:
    """The LoRA fine-tuning of the job configured by ``cfg`` (``model.lora``), if it trained adapters. A job saved
    before model options had a ``_target_`` holds the keys alone, or null: read as the same option."""
    node = OmegaConf.select(cfg, "model.lora")
    if node is None:
        return None
    settings = cast(dict[str, Any], OmegaConf.to_container(node))
    lora = instantiate(node) if "_target_" in settings else LoRAFineTuning(**settings)
    return lora if lora.enabled else None


def merged_model_state(checkpoint: str | Path, cfg: DictConfig) -> dict[str, torch.Tensor]:
    """The model's weights in ``checkpoint`` (a file or a sharded dir, of the job configured by ``cfg``), whole. A
    LoRA run's checkpoint holds its adapters alone: its frozen base is rebuilt here as the run built it (from
    ``model.init_from``'s weights, or drawn from the seed), and the adapters are merged into it."""
    state = model_state(checkpoint)
    lora = trained_lora(cfg)
    if lora is None:
        return state
    with torch.device("meta"):
        net = instantiate(cfg.model.net)
    lora.build(net)
    adapters = {name for name, parameter in net.named_parameters() if parameter.requires_grad}
    if set(state) != adapters:  # else the missing adapters would be filled with their start, B = 0: no update
        raise ConfigError(
            "checkpoint",
            f"differs from this LoRA run's adapters in {sorted(set(state) ^ adapters)[:3]}: it is not its checkpoint.",
            "pass a checkpoint of this run, with its job's --config.",
        )
    weights = InitialWeights(OmegaConf.select(cfg, "model.init_from"), cfg.model.init_seed)
    lora.check_base(checkpoint_meta(checkpoint).get("lora_base"), weights)
    init_from = weights.init_from
    materialize(net, torch.device("cpu"), weights.seed, HFWeights(init_from) if init_from else None)
    # A QLoRA base merges as the run computed with it: dequantized.
    return merged(dequantized({**net.state_dict(), **state}), lora.alpha / lora.rank)
