"""OmegaConf resolvers that configs use to derive one setting from others. OmegaConf only: ``train.py`` registers
them before Hydra composes anything, so ``--help`` stays fast."""

from typing import cast

from omegaconf import DictConfig, OmegaConf

from project.data.prepared import prepared_meta


def optuna_direction(mode: str) -> str:
    """hparams_search: Optuna's direction from a metric's mode (max or min); another mode as it is, which the
    sweeper refuses, naming optimized_metric.mode (raised here, it would be a traceback of Hydra's)."""
    return {"max": "maximize", "min": "minimize"}.get(mode, mode)


def gpus_per_node(accelerator: str, devices: int) -> int | None:
    """launcher=slurm: the GPUs a node's task asks for: one per device; none (no GPU request) for CPU training."""
    return None if accelerator == "cpu" else devices


def wandb_x_axis(val_check_interval: int | float | None) -> str:
    """logger=wandb: chart by optimizer step when validation runs within epochs (every N batches or a fraction of
    one: several rows an epoch, or runs shorter than one), else by epoch."""
    at_epoch_end = val_check_interval is None or (isinstance(val_check_interval, float) and val_check_interval == 1.0)
    return "epoch" if at_epoch_end else "step"


def prepared_vocab_size(path: str) -> int:
    """data=shards: the vocabulary size a prepared corpus records, for the model's embedding."""
    return prepared_meta(path)["vocab_size"]


def tokenizer_vocab_size(model_dir: str) -> int:
    """data=chat: the vocabulary of a model dir's tokenizer.json, for the model's embedding."""
    from project.data.templated import tokenizer_vocab_size as read  # tokenizers, only when a config asks

    return read(model_dir)


def sweep_job() -> str | None:
    """``job N`` in a sweep's job N (Hydra's job number; an Optuna search's trial number), None in a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    # A DictConfig at run time, whatever its hint says; job.num is missing in the sweep's own config (its jobs' not).
    number = OmegaConf.select(cast(DictConfig, HydraConfig.get()), "job.num")
    return None if number is None else f"job {number}"


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("optuna_direction", optuna_direction, replace=True)
    OmegaConf.register_new_resolver("gpus_per_node", gpus_per_node, replace=True)
    OmegaConf.register_new_resolver("prepared_vocab_size", prepared_vocab_size, replace=True)
    OmegaConf.register_new_resolver("tokenizer_vocab_size", tokenizer_vocab_size, replace=True)
    OmegaConf.register_new_resolver("wandb_x_axis", wandb_x_axis, replace=True)
    OmegaConf.register_new_resolver("sweep_job", sweep_job, replace=True)
