"""Files written whole or not at all, and one message when the disk says no."""

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from project.options.errors import WriteFailed


@contextmanager
def written(path: str | Path, what: str, fix: str) -> Iterator[Path]:
    """Yields ``<path>.partial`` for the block to write (a file, or a dir); once the block is done it replaces
    ``path``, so a reader sees the old file or the new one, never half of one.

    Any error removes the partial file, which frees what it took; one that an ``OSError`` caused (``ENOSPC``: the
    disk is full; also where a writer turned it into its own error, as ``torch.save``'s zip writer does) is raised
    as ``WriteFailed`` (``write_failed``)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield partial
        os.replace(partial, path)
    except Exception as error:
        remove(partial)
        cause = os_error(error)
        if cause is None:
            raise
        raise write_failed(path, what, cause, fix) from error


def os_error(error: BaseException) -> OSError | None:
    """``error`` if it is an ``OSError``, else the first one in its chain of causes, if any."""
    seen: BaseException | None = error
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen


def full_disk(path: Path) -> OSError | None:
    """``ENOSPC`` if the file system holding ``path`` has no space left for this process, else None: the cause of
    a failed write whose ``OSError`` was lost on the way (DCP gathers each rank's failure without its chain)."""
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    stats = os.statvfs(existing)
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if stats.f_bavail * stats.f_frsize == 0 else None


def write_failed(path: Path, what: str, error: OSError, fix: str) -> WriteFailed:
    """The ``WriteFailed`` for ``error``: "Could not write <what> <path>: <cause> (<errno>). <fix>"."""
    code = errno.errorcode.get(error.errno, type(error).__name__) if error.errno else type(error).__name__
    return WriteFailed(f"Could not write {what} {path}: {error.strerror or error} ({code}). {fix}")


def remove(path: Path) -> None:
    """Remove ``path`` (a file or a dir) if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
