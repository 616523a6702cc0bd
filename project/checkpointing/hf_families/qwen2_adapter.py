"""Qwen 2 (``model_type`` qwen2): Llama's decoder with biases on its query, key and value projections (always: no key
of its config says so), and a sliding window only under ``use_sliding_window``."""

from typing import Any

from torch import nn

from project.checkpointing.hf_families.llama_adapter import LlamaFamily
from project.models import Llama


def qwen_sliding_window(config: dict[str, Any]) -> int | None:
    """Qwen's attention window: 4,096 tokens unless its config says otherwise, and only under
    ``use_sliding_window``."""
    return config.get("sliding_window", 4096) if config.get("use_sliding_window") else None


class Qwen2Family(LlamaFamily):
    model_type = "qwen2"
    model_group = "qwen2"
    architecture = "Qwen2ForCausalLM"
    qkv_bias = True

    def sliding_window(self, config: dict[str, Any]) -> int | None:
        return qwen_sliding_window(config)

    def writes(self, net: nn.Module, net_cfg: dict[str, Any]) -> bool:
        return isinstance(net, Llama) and bool(net_cfg.get("qkv_bias")) and not net_cfg.get("qk_norm")
