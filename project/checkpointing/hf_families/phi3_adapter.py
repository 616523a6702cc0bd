"""Phi-3 (``model_type`` phi3): Llama's decoder with its query, key and value projections stored as one tensor
(``qkv_proj``: [query; key; value], fewer key and value rows under grouped-query attention) and its gate and up
projections as another (``gate_up_proj``: [gate; up]). Separate here, so that tensor parallelism shards each by heads
or units; read, written as a Llama."""

from typing import Any

from torch import nn

from project.checkpointing.hf_families.llama_adapter import LlamaFamily


class Phi3Family(LlamaFamily):
    model_type = "phi3"
    model_group = "phi3"
    names = {
        "stem.tokens.weight": "model.embed_tokens.weight",
        "blocks.{i}.norm1.weight": "model.layers.{i}.input_layernorm.weight",
        "blocks.{i}.attention.o.weight": "model.layers.{i}.self_attn.o_proj.weight",
        "blocks.{i}.attention.{p}.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
        "blocks.{i}.norm2.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blocks.{i}.mlp.down.weight": "model.layers.{i}.mlp.down_proj.weight",
        "blocks.{i}.mlp.{p}.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
        "head.norm.weight": "model.norm.weight",
        "head.output.weight": "lm_head.weight",
    }
    fused = [("q", "k", "v"), ("gate", "up")]

    def sliding_window(self, config: dict[str, Any]) -> int | None:
        return config.get("sliding_window")

    def part_rows(self, config: dict[str, Any]) -> dict[str, int]:
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_rows = (config.get("num_key_value_heads") or heads) * head_dim
        return {
            "q": heads * head_dim,
            "k": kv_rows,
            "v": kv_rows,
            "gate": config["intermediate_size"],
            "up": config["intermediate_size"],
        }

    def writes(self, net: nn.Module, net_cfg: dict[str, Any]) -> bool:
        return False  # its parts written apart: a Llama
