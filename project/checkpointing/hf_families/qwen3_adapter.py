"""Qwen 3 (``model_type`` qwen3): Llama's decoder with each query and key head RMS-normalised before RoPE (its
``q_norm`` and ``k_norm``), and Qwen's sliding window rule."""

from typing import Any

from torch import nn

from project.checkpointing.hf_families.llama_adapter import LlamaFamily
from project.checkpointing.hf_families.qwen2_adapter import qwen_sliding_window
from project.models import Llama


class Qwen3Family(LlamaFamily):
    model_type = "qwen3"
    model_group = "qwen3"
    architecture = "Qwen3ForCausalLM"
    qk_norm = True

    def sliding_window(self, config: dict[str, Any]) -> int | None:
        return qwen_sliding_window(config)

    def writes(self, net: nn.Module, net_cfg: dict[str, Any]) -> bool:
        return isinstance(net, Llama) and bool(net_cfg.get("qk_norm"))
