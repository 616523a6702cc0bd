"""Checkpoints: atomic writes and reads of Lightning's files (``files``), the latest-and-best callback, and Hugging
Face weights in and out (``hf``)."""

from project.checkpointing.latest_and_best import LatestAndBestCheckpoint

__all__ = ["LatestAndBestCheckpoint"]
