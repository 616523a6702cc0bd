"""Lightning callbacks of this project."""

from project.callbacks.throughput import EpochThroughput

__all__ = ["EpochThroughput"]
