"""What people at a terminal see: the composed config as a tree, and Lightning's log lines once each."""

import logging

import rich
import rich.syntax
import rich.tree
from omegaconf import DictConfig, OmegaConf

# Groups first in this order, then any other top-level keys.
FIRST = ("choices", "overrides", "model", "data", "strategy", "trainer", "logger", "callbacks", "paths")


def print_config_tree(cfg: DictConfig) -> None:
    """Print each top-level section of the (resolved) config as a branch of YAML."""
    tree = rich.tree.Tree("CONFIG", style="bold", guide_style="dim")
    keys = [key for key in FIRST if key in cfg] + [key for key in cfg if key not in FIRST]
    for key in keys:
        value = cfg[key]
        text = OmegaConf.to_yaml(value) if isinstance(value, DictConfig) else str(value)
        tree.add(f"[bold]{key}[/]").add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    rich.print(tree)


def lightning_logs_through_root() -> None:
    """``import lightning`` gives its loggers console handlers of their own ("lightning.pytorch" and
    "lightning.fabric" stop propagating); drop them, so that Lightning's records reach the root logger's handlers
    (the console and the job's log file) once."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
