"""The error users see for a config that cannot work. Kept free of heavy imports, so ``train.py`` (and its
``--help``) can catch it without loading torch."""

import sys
from typing import NoReturn


class ConfigError(ValueError):
    """A config value that cannot work; ``str()`` is the message for the user: the key, the problem and the fix."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        problem, fix = " ".join(problem.split()), " ".join(fix.split())  # one paragraph, whatever a library said
        super().__init__(f"{key}: {problem} Fix: {fix}")
        self.key, self.problem, self.fix = key, problem, fix

    def __reduce__(self) -> tuple:  # picklable, so that torchrun's rank 0 can send it to the other ranks
        return ConfigError, (self.key, self.problem, self.fix)


class JobFailed(RuntimeError):
    """A job's workers failed; the launcher has printed and logged which rank failed and how (the message)."""


def positive_int(key: str, value: object, fix: str) -> int:
    """``value`` if it is an integer of at least 1, else ``ConfigError`` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"must be a positive integer, got {value!r}.", fix)
    return value


def number_in(key: str, value: object, low: float, high: float, fix: str) -> float:
    """``value`` if it is a number with ``low < value < high``, else ``ConfigError`` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
        raise ConfigError(key, f"must be a number between {low} and {high} (both excluded), got {value!r}.", fix)
    return value


def exit_with(error: ConfigError) -> NoReturn:
    """End the process as every bad input does: exit code 1 and the error's one paragraph, no traceback."""
    sys.exit(f"Config error: {error}")
