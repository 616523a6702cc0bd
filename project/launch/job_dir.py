"""One live job per job dir: a lock held for as long as the job runs. Standard library only."""

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from project.options.errors import ConfigError

LOCK_FILE = ".job.lock"


# Dirs whose lock this process holds until it exits (``hold_job_dir``): the lock file's descriptor, by resolved path.
_HELD: dict[Path, int] = {}


def hold_job_dir(job_dir: str | Path, key: str) -> None:
    """Take ``job_dir``'s lock for the rest of this process's life, before anything is written into the dir
    (``JobDirCheck``, as Hydra starts a run or sweep); ``ConfigError`` naming ``key`` if a live job holds it."""
    path = Path(job_dir).resolve()
    if path not in _HELD:
        _HELD[path] = _take_lock(path, key)


@contextmanager
def job_dir_lock(job_dir: str | Path, key: str) -> Iterator[None]:
    """Hold ``<job_dir>/.job.lock`` while the job runs; ``ConfigError`` (naming ``key``, the config key that
    chose the dir) if a live job holds it. A dir this process already holds (``hold_job_dir``) stays held.

    The lock is the kernel's (``flock``): it goes with the process that holds it, however that process ends, so
    the lock of a killed job is simply taken over. The file says who holds it, for the error message.
    """
    path = Path(job_dir).resolve()
    if path in _HELD:
        yield
        return
    fd = _take_lock(path, key)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def _take_lock(job_dir: Path, key: str) -> int:
    """The descriptor of ``job_dir``'s lock file, locked by this process (closing it releases the lock)."""
    path = job_dir / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the workers: the launcher holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            key,
            f"{job_dir} is in use by a running job ({_holder(path)}).",
            "wait for that job to end or stop it, or run in another dir (leave the key unset for a new dir of its "
            "own).",
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
    return fd


def live_holder(job_dir: str | Path) -> str | None:
    """Who holds ``job_dir``'s lock (``pid ... on <host>, since ...``) if a live process does, else None: the lock
    goes with its process, so a dir whose job was killed is free. This process's own lock counts as held."""
    path = Path(job_dir) / LOCK_FILE
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(path)
    finally:
        os.close(fd)  # releases the shared lock if it was taken
    return None


def _holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {holder['pid']} on {holder['host']}, since {since}"
    except (OSError, ValueError, KeyError):
        return "its lock file does not say which"
