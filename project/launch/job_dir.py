"""One live job per job dir: a lock held for as long as the job runs. Standard library only."""

import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from project.config.errors import ConfigError

LOCK_FILE = ".job.lock"


@contextmanager
def job_dir_lock(job_dir: str | Path, key: str) -> Iterator[None]:
    """Hold ``<job_dir>/.job.lock`` while the job runs; ``ConfigError`` (naming ``key``, the config key that
    chose the dir) if a live job holds it.

    The lock is the kernel's (``flock``): it goes with the process that holds it, however that process ends, so
    the lock of a killed job is simply taken over. The file says who holds it, for the error message.
    """
    path = Path(job_dir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the workers: the launcher holds it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                key,
                f"{job_dir} is in use by a running job ({_holder(path)}).",
                "wait for that job to end or stop it, or run in another dir (leave the key unset for "
                "a new dir of its own).",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {holder['pid']} on {holder['host']}, since {since}"
    except (OSError, ValueError, KeyError):
        return "its lock file does not say which"
