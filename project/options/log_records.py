"""Marks on log records. ``log.info(..., extra=LOG_FILE_ONLY)``: a record for the job's log file, not the console
(the normal course of things, said once per rank); ``project.observability.console.LogFileOnly`` drops it there. And
``quieted``: other libraries' loggers held above a level for a while."""

import logging
from collections.abc import Iterator
from contextlib import contextmanager

LOG_FILE_ONLY_KEY = "log_file_only"
LOG_FILE_ONLY = {LOG_FILE_ONLY_KEY: True}


@contextmanager
def quieted(*names: str, level: int = logging.ERROR) -> Iterator[None]:
    """Within it, the loggers ``names`` drop records below ``level`` (their own levels back after)."""
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, own in zip(loggers, saved):
            logger.setLevel(own)
