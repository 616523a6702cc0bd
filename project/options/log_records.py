"""Marks on log records. ``log.info(..., extra=LOG_FILE_ONLY)``: a record for the job's log file, not the console
(the normal course of things, said once per rank); ``project.observability.console.LogFileOnly`` drops it there."""

LOG_FILE_ONLY_KEY = "log_file_only"
LOG_FILE_ONLY = {LOG_FILE_ONLY_KEY: True}
