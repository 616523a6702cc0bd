"""The rules a callback or a logger holds a run's config to (``ConfigRules``), declared by its class and checked
before launch: ``project.config.checks.check_config`` asks them of every configured callback and logger whose class
declares them. Here, in the bottom layer, so that a class of any layer can declare them (the checkpoint callback's
sits below the data modules' users)."""

from abc import ABC, abstractmethod
from typing import Protocol

from omegaconf import DictConfig


class RunData(Protocol):
    """What such rules may ask of the run's data module (``project.data.datamodule.DataModule`` offers it)."""

    def text_codec(self) -> object | None: ...


class ConfigRules(ABC):
    """A callback or logger class with rules on the config of a run that uses it."""

    @staticmethod
    @abstractmethod
    def check_run_config(cfg: DictConfig, node: str, data: RunData) -> None:
        """Raise ``ConfigError`` for the first of the class's rules that ``cfg`` breaks, for its node at ``node``
        (``callbacks.<name>``, ``logger.<name>``: what its keys start with), training on ``data``."""
