"""Plain PyTorch models, each ``head(blocks(stem(x)))`` (``BlockSequence``): ``blocks`` is the ordered block sequence
strategies shard
or split; ``stem`` goes with the first stage, ``head`` with the last. Each model says how a parameter starts
(``init_parameter``); ``project.models.init`` draws every parameter from the seed, so models can be built on the
meta device and materialised piece by piece."""

from project.models.gpt import GPT
from project.models.init import init_weights
from project.models.llama import Llama
from project.models.mlp import MLP
from project.models.moe import MoE
from project.models.sequence import BlockSequence

__all__ = ["BlockSequence", "GPT", "Llama", "MLP", "MoE", "init_weights"]
