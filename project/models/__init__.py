"""Plain PyTorch models, each ``head(blocks(stem(x)))``: ``blocks`` is the ordered block sequence strategies shard
or split; ``stem`` goes with the first stage, ``head`` with the last."""

from project.models.gpt import GPT
from project.models.mlp import MLP

__all__ = ["GPT", "MLP"]
