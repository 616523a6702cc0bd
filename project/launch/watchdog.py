"""The launcher's hang watchdog: a worker whose heartbeat goes silent for ``strategy.heartbeat_timeout`` fails the
job in about that time, instead of after the collective timeout (minutes) plus torchelastic's grace, and leaves
every rank's Python stack in the job's log.

Why heartbeats rather than progress: a worker beats from a thread of its own (``project.launch.processes``), so a
long compile, checkpoint or validation goes on beating, and so does a rank that waits in a collective for a stuck
peer. What stops the beats is a stopped process, or one stuck in code that holds the interpreter: the rank to
name.
"""

import logging
import os
import signal
import threading
import time
from contextlib import suppress
from pathlib import Path
from types import TracebackType

from project.launch.processes import HEARTBEAT_INTERVAL_S, STACK_DUMP_SIGNAL, heartbeat_file, stack_file

log = logging.getLogger(__name__)

STACK_DUMP_WAIT_S = 2.0  # how long the ranks get to write their stacks before the silent one is killed


def _is_running(pid: int) -> bool:
    """``pid`` is alive and has not exited (a zombie, not yet reaped by torchelastic, has); a stopped one is."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


class HeartbeatWatchdog:
    """While entered, watch the heartbeat files in ``heartbeat_dir`` from a thread (``timeout_s`` None: not at
    all). The first running worker silent for ``timeout_s``: every worker dumps its stacks into ``job_log``, the
    silent one is killed (torchelastic then stops the rest and the launcher reports the failure), and ``silent``
    holds ``(rank, seconds silent)``."""

    def __init__(self, heartbeat_dir: Path, timeout_s: float | None, job_log: Path) -> None:
        self.heartbeat_dir, self.timeout_s, self.job_log = heartbeat_dir, timeout_s, job_log
        self.silent: tuple[int, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="heartbeat-watchdog", daemon=True)

    def __enter__(self) -> "HeartbeatWatchdog":
        if self.timeout_s is not None:
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _workers(self) -> dict[int, int]:
        """Rank to pid of each worker that has started beating."""
        workers = {}
        for beat in self.heartbeat_dir.glob("rank*"):
            if beat.suffix:  # a stack file
                continue
            try:
                workers[int(beat.name.removeprefix("rank"))] = int(beat.read_text())
            except (OSError, ValueError):
                continue  # being written
        return workers

    def _watch(self) -> None:
        assert self.timeout_s is not None
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            for rank, pid in sorted(self._workers().items()):
                try:
                    silent_for = time.time() - heartbeat_file(self.heartbeat_dir, rank).stat().st_mtime
                except OSError:
                    continue
                if silent_for > self.timeout_s and _is_running(pid):
                    self._fail(rank, pid, silent_for)
                    return

    def _fail(self, rank: int, pid: int, silent_for: float) -> None:
        self.silent = (rank, silent_for)
        log.error(
            f"Rank {rank} (pid {pid}) has sent no heartbeat for {silent_for:.0f} s (strategy.heartbeat_timeout="
            f"{self.timeout_s:g}): it is stopped, or stuck holding the interpreter. Every rank's Python stack goes "
            f"to {self.job_log}, then the job is stopped."
        )
        workers = self._workers()
        for worker in workers.values():
            for sig in (signal.SIGCONT, STACK_DUMP_SIGNAL):  # a stopped process runs its handler once continued
                with suppress(ProcessLookupError):
                    os.kill(worker, sig)
        time.sleep(STACK_DUMP_WAIT_S)
        with self.job_log.open("a") as job_log:
            for worker_rank, worker in sorted(workers.items()):
                stacks = stack_file(self.heartbeat_dir, worker_rank)
                text = stacks.read_text() if stacks.exists() else ""
                job_log.write(
                    f"\n--- Python stacks of rank {worker_rank} (pid {worker}), dumped by the hang watchdog ---\n"
                    f"{text or '(none written: the process did not respond)'}\n"
                )
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
