"""Mistral (``model_type`` mistral): Llama's decoder with a sliding attention window, 4,096 tokens unless its config
says otherwise; read when the window covers the sequence trained here, written as a Llama (``llama_adapter``)."""

from typing import Any

from torch import nn

from project.checkpointing.hf_families.llama_adapter import LlamaFamily


class MistralFamily(LlamaFamily):
    model_type = "mistral"
    model_group = "mistral"

    def sliding_window(self, config: dict[str, Any]) -> int | None:
        return config.get("sliding_window", 4096)

    def writes(self, net: nn.Module, net_cfg: dict[str, Any]) -> bool:
        return False  # without its window, which this project does not train, a Llama
