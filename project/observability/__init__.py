"""What a run shows: per-epoch loggers (W&B, CSV), throughput and MFU, device memory, the model summary, the progress
bar, text samples, the console."""

from project.observability.device_memory import DeviceMemory
from project.observability.model_summary import WholeModelSummary
from project.observability.progress import TimedRichProgressBar
from project.observability.text_sample import TextSample
from project.observability.throughput import EpochThroughput

__all__ = ["DeviceMemory", "EpochThroughput", "TextSample", "TimedRichProgressBar", "WholeModelSummary"]
