"""Lightning callbacks of this project."""

from project.callbacks.checkpoint import LatestAndBestCheckpoint
from project.callbacks.job_result import JobResult
from project.callbacks.memory import DeviceMemory
from project.callbacks.progress import TimedRichProgressBar
from project.callbacks.sigterm import StopTogetherOnSigterm
from project.callbacks.text_sample import TextSample
from project.callbacks.throughput import EpochThroughput

__all__ = ["DeviceMemory", "EpochThroughput", "JobResult", "LatestAndBestCheckpoint", "StopTogetherOnSigterm", "TextSample",
           "TimedRichProgressBar"]
