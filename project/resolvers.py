"""OmegaConf resolvers that configs use to derive one setting from others. OmegaConf only: ``train.py`` registers
them before Hydra composes anything, so ``--help`` stays fast."""

from omegaconf import OmegaConf


def optuna_direction(mode: str) -> str:
    """hparams_search: Optuna's direction from a metric's mode (max or min)."""
    return {"max": "maximize", "min": "minimize"}[mode]


def gpus_per_node(accelerator: str, devices: int) -> int | None:
    """launcher=slurm: the GPUs a node's task asks for: one per device; none (no GPU request) for CPU training."""
    return None if accelerator == "cpu" else devices


def register_resolvers() -> None:
    OmegaConf.register_new_resolver("optuna_direction", optuna_direction, replace=True)
    OmegaConf.register_new_resolver("gpus_per_node", gpus_per_node, replace=True)
