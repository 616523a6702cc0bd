"""The error users see for a config that cannot work. Kept free of heavy imports, so ``train.py`` (and its
``--help``) can catch it without loading torch."""

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, TypeVar

Built = TypeVar("Built")


class ConfigError(ValueError):
    """A config value that cannot work; ``str()`` is the message for the user: the key, the problem and the fix."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        problem, fix = " ".join(problem.split()), " ".join(fix.split())  # one paragraph, whatever a library said
        super().__init__(f"{key}: {problem} Fix: {fix}")
        self.key, self.problem, self.fix = key, problem, fix

    def __reduce__(self) -> tuple:  # picklable, so that torchrun's rank 0 can send it to the other ranks
        return ConfigError, (self.key, self.problem, self.fix)


class JobFailed(RuntimeError):
    """A job failed, and has printed and logged why (the message): its workers (the launcher names which rank and
    how), a diverged step, a file it could not write."""


class JobStopped(JobFailed):
    """A signal stopped the job (a preemption's SIGTERM, Ctrl-C's SIGINT); the message says how to resume. A sweep
    stops with it, and the process exits with 128 + the signal's number, as a shell reports a signalled command."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum

    def __reduce__(self) -> tuple:
        return JobStopped, (str(self), self.signum)


class WriteFailed(JobFailed):
    """A file could not be written (a full disk, a dir turned read-only); the message names it, the cause and the
    fix, and the half-written file is gone (``project.options.writes.written``)."""


def positive_int(key: str, value: object, fix: str) -> int:
    """``value`` if it is an integer of at least 1, else ``ConfigError`` naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f"must be a positive integer, got {value!r}.", fix)
    return value


def cannot_build(key: str, problem: str) -> ConfigError:
    """The refusal of the config node at ``key``, whose object fails to build with ``problem``."""
    return ConfigError(
        key,
        f"cannot be built: {problem}.",
        f"check {key}._target_ and its options (python train.py --cfg job prints them).",
    )


def built(key: str, build: Callable[[], Built]) -> Built:
    """``build()``, the object of the config node at ``key``; a ``ConfigError`` it raises comes out as it is, any
    other error as the node's (``cannot_build``)."""
    try:
        return build()
    except ConfigError:
        raise
    except Exception as error:
        raise cannot_build(key, f"{type(error).__name__}: {error}") from None


def exit_with(error: ConfigError) -> NoReturn:
    """End the process as every bad input does: exit code 1 and the error's one paragraph, no traceback."""
    sys.exit(f"Config error: {error}")


def made_dir(key: str, directory: str | Path, fix: str) -> Path:
    """``directory``, made where it is not there; ``ConfigError`` naming ``key`` where it cannot be made or written.
    Made, not only asked (``check_writable``): root passes ``os.access`` where no dir can be made, as in /proc."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(key, f"{path} cannot be created: {error.strerror or error}.", fix) from None
    if not os.access(path, os.W_OK | os.X_OK):  # it exists, on a read-only file system or without the rights
        raise ConfigError(key, f"{path} is not writable by this process.", fix)
    return path


def check_writable(key: str, directory: str | Path, fix: str) -> None:
    """``ConfigError`` naming ``key`` unless this process could create files in ``directory``: in it if it
    exists, else in its nearest existing parent (where it would be made, which is tried: an empty dir made and
    removed at once). A refused job leaves no trace. ``os.access`` sees what stops root too: an immutable dir
    (chattr +i), a read-only file system."""
    path = Path(directory).expanduser().absolute()
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not existing.is_dir():
        raise ConfigError(key, f"{path} cannot be a directory: {existing} is a file.", fix)
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" (it does not exist yet, and {existing} is where it would be made)"
        raise ConfigError(key, f"{path} is not writable by this process{where}.", fix)
    if existing != path:  # root passes os.access where no dir can be made (/proc): make its first part, unmade
        first = path.relative_to(existing).parts[0]
        try:
            (existing / first).mkdir()
        except FileExistsError:
            return  # made meanwhile by another process
        except OSError as error:
            raise ConfigError(key, f"{path} cannot be made in {existing}: {error.strerror or error}.", fix) from None
        (existing / first).rmdir()
