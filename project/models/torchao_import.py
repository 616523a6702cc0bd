"""torchao, an optional dependency (QLoRA's NF4, Float8 training), imported only when a run asks for it."""

import importlib
from types import ModuleType

from project.options.errors import ConfigError
from project.options.log_records import quieted


def import_torchao(module: str, key: str, fix: str) -> ModuleType:
    """torchao's ``module``, imported quietly (torchao logs a warning for each GPU kernel library it cannot load on
    this machine, and torch one for each of its types it registers), or a ``ConfigError`` naming ``key`` and
    ``fix`` without torchao."""
    with quieted("torchao", "torch.utils._pytree"):
        try:
            return importlib.import_module(module)
        except ImportError:
            raise ConfigError(key, "needs torchao, which is not installed.", fix) from None
