"""A worker process of a multi-device job: ``python -m project.launch.worker <job dir>/config.yaml``.

Started by ``project.launch.launcher.launch_workers`` with torchelastic's environment (RANK, WORLD_SIZE,
MASTER_ADDR...).
"""

import logging
import os
import signal
import sys
from pathlib import Path
from typing import cast

from project.launch.processes import (
    JOB_LOG_VARIABLE,
    die_with_parent,
    interrupt_once,
    start_heartbeat,
    stop_on_early_warning,
)

die_with_parent()  # before the slow imports below, so that a launcher killed during start-up takes this along
start_heartbeat(int(os.environ["RANK"]))
stop_on_early_warning()
interrupt_once()

from omegaconf import DictConfig, OmegaConf  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from project.launch.training import train  # noqa: E402
from project.observability.console import lightning_logs_through_root  # noqa: E402
from project.options.errors import JobStopped  # noqa: E402


def log_to_job(log_file: Path, rank: int) -> logging.Logger:
    """Log records to the console, as before, and to the job's log file (Hydra's ``train.log``, which the launcher
    keeps), each line marked with its rank. Returns a logger that writes to the file alone."""
    formatter = logging.Formatter(f"[%(asctime)s][rank {rank}][%(name)s][%(levelname)s] - %(message)s")
    console, file = logging.StreamHandler(sys.stdout), logging.FileHandler(log_file, mode="a")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in (console, file):
        handler.setFormatter(formatter)
        root.addHandler(handler)
    lightning_logs_through_root()
    file_only = logging.getLogger("project.launch.worker.file")
    file_only.propagate = False
    file_only.addHandler(file)
    return file_only


@record  # writes this worker's traceback where the launcher can report it
def main(config_file: str) -> None:
    rank = int(os.environ["RANK"])
    file_log = log_to_job(Path(os.environ[JOB_LOG_VARIABLE]), rank)
    try:
        train(cast(DictConfig, OmegaConf.load(config_file)))  # the job's config: a mapping
    except JobStopped as stop:  # stopped on request (a preemption): the launcher says so, no traceback needed
        sys.exit(128 + stop.signum)
    except BaseException:
        file_log.exception(f"Rank {rank} failed")  # the traceback; the console gets the launcher's report
        raise


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception:  # in train.log with its traceback, and in the error file the launcher's report quotes
        sys.exit(1)
    finally:  # leaving: a Ctrl-C that reaches this worker only now would interrupt an exit hook (a traceback)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
