"""Plain PyTorch models. Each exposes ``blocks``: the ordered block sequence strategies shard or split."""

from project.models.mlp import MLP

__all__ = ["MLP"]
