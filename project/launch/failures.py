"""What the launcher says when its workers fail: which rank, and how, the likely cause first."""

import os
import signal
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from project.launch.processes import HEARTBEAT_INTERVAL_S, heartbeat_file

# A heartbeat older than this when the first rank failed means the rank had stopped responding.
STALE_AFTER_S = 5 * HEARTBEAT_INTERVAL_S


def _raised(failure: ProcessFailure) -> str | None:
    """The exception a rank raised, on one line, from the error file ``@record`` wrote; None if it wrote none."""
    if not os.path.isfile(failure.error_file):
        return None
    message = failure.message["message"] if isinstance(failure.message, dict) else failure.message
    return " ".join(message.split())


def failure_report(
    error: ChildFailedError,
    num_workers: int,
    log_dir: Path,
    heartbeat_dir: Path,
    silent: tuple[int, float] | None,
    job_log: Path,
) -> str:
    """One line per failed rank, the likely cause first: the rank the hang watchdog killed (``silent``: its rank
    and how long it sent no heartbeat; the stacks are in ``job_log``), or a rank that had stopped responding (its
    heartbeat went stale before anything failed: stopped, or stuck), then a rank killed by a signal from outside,
    then ranks that raised, in time order (a rank that loses its peer raises in its next collective); ranks that
    were still running are not listed, the launcher stopped them."""
    failures = error.failures
    raised = {rank: _raised(failure) for rank, failure in failures.items()}
    first_failure = min((f.timestamp for rank, f in failures.items() if raised[rank]), default=time.time())
    lines = []
    for rank, failure in sorted(failures.items(), key=lambda item: item[1].timestamp):
        beat = heartbeat_file(heartbeat_dir, rank)
        last_beat = beat.stat().st_mtime if beat.exists() else None
        if silent is not None and rank == silent[0]:
            lines.append(
                (
                    0,
                    f"rank {rank} sent no heartbeat for {silent[1]:.0f} s (a stopped process, or one stuck holding "
                    f"the interpreter), so the launcher killed it; every rank's Python stack is in {job_log}.",
                )
            )
        elif last_beat is not None and first_failure - last_beat > STALE_AFTER_S:
            lines.append(
                (
                    0,
                    f"rank {rank} stopped responding at {time.strftime('%H:%M:%S', time.localtime(last_beat))}, "
                    f"{first_failure - last_beat:.0f} s before the first failure (a stopped process, or one "
                    "stuck outside Python), so the others timed out waiting for it; it was then killed.",
                )
            )
        elif raised[rank]:
            lines.append((2, f"rank {rank} raised {raised[rank]} (its traceback is in {job_log})."))
        elif failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM:
            lines.append((1, f"rank {rank} was killed by {failure.signal_name()}."))
        elif failure.exitcode > 0:
            lines.append((2, f"rank {rank} exited with code {failure.exitcode}."))
    lines.sort(key=lambda line: line[0])  # stable: time order within each kind
    body = "\n".join(f"- {line}" for _, line in lines) or "- no rank says why (each was stopped by a signal)."
    return (
        f"Training failed in the workers:\n{body}\nAll {num_workers} workers were stopped; their logs are in {log_dir}."
    )
