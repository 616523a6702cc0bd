"""GPT-2 (``model_type`` gpt2) as this project's ``GPT``: learned positions, LayerNorm, GELU, its linear layers
stored transposed (its ``Conv1D``), its query, key and value projections as one tensor (``c_attn``), of which this
project's ``q``, ``k`` and ``v`` are thirds."""

import re
from typing import Any

import torch
from torch import nn

from project.checkpointing.hf_families.family import NO_TOKEN_IDS, HFFamily, variant
from project.models import GPT

# GPT-2's GELU spellings in transformers: the exact one, and the tanh approximation under two names.
GPT2_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class GPT2Family(HFFamily):
    model_type = "gpt2"
    model_group = "gpt"
    net_class = GPT
    names = {
        "stem.tokens.weight": "transformer.wte.weight",
        "stem.positions.weight": "transformer.wpe.weight",
        "blocks.{i}.norm1.{p}": "transformer.h.{i}.ln_1.{p}",
        "blocks.{i}.attention.q.{p}": "transformer.h.{i}.attn.c_attn.{p}",
        "blocks.{i}.attention.k.{p}": "transformer.h.{i}.attn.c_attn.{p}",
        "blocks.{i}.attention.v.{p}": "transformer.h.{i}.attn.c_attn.{p}",
        "blocks.{i}.attention.proj.{p}": "transformer.h.{i}.attn.c_proj.{p}",
        "blocks.{i}.norm2.{p}": "transformer.h.{i}.ln_2.{p}",
        "blocks.{i}.mlp.up.{p}": "transformer.h.{i}.mlp.c_fc.{p}",
        "blocks.{i}.mlp.down.{p}": "transformer.h.{i}.mlp.c_proj.{p}",
        "head.norm.{p}": "transformer.ln_f.{p}",
        "head.output.weight": "lm_head.weight",
    }
    tied_input = "transformer.wte.weight"
    tied_by_default = True
    fused = [("q", "k", "v")]  # c_attn is [query; key; value]
    transposed = re.compile(r"h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
    position_table = True

    def net_options(self, config: dict[str, Any]) -> dict[str, Any]:
        if config.get("n_inner") not in (None, 4 * config["n_embd"]) or config.get("layer_norm_epsilon", 1e-5) != 1e-5:
            raise variant("an MLP width other than 4 x n_embd, or a LayerNorm epsilon other than 1e-5")
        if config.get("activation_function", "gelu_new") not in GPT2_GELU:
            raise variant(f"activation_function {config['activation_function']!r} (GELU only)")
        if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx"):
            raise variant("attention scores scaled otherwise than by 1/sqrt(head width)")
        return {
            "vocab_size": config["vocab_size"],
            "max_length": config["n_positions"],
            "num_layers": config["n_layer"],
            "dim": config["n_embd"],
            "num_heads": config["n_head"],
            "tie_weights": self.is_tied(config),
            "gelu_approximate": GPT2_GELU[config.get("activation_function", "gelu_new")],
        }

    def part_rows(self, config: dict[str, Any]) -> dict[str, int]:
        return dict.fromkeys("qkv", config["n_embd"])

    def writes(self, net: nn.Module, net_cfg: dict[str, Any]) -> bool:
        return isinstance(net, GPT)

    def hf_config(self, net_cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
        return {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": net_cfg["vocab_size"],
            "n_positions": net_cfg["max_length"],
            "n_embd": net_cfg["dim"],
            "n_layer": net_cfg["num_layers"],
            "n_head": net_cfg["num_heads"],
            "n_inner": None,
            "layer_norm_epsilon": 1e-5,
            "activation_function": "gelu" if net_cfg.get("gelu_approximate", "none") == "none" else "gelu_new",
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "tie_word_embeddings": bool(net_cfg.get("tie_weights")),
            "torch_dtype": str(dtype).removeprefix("torch."),
            **NO_TOKEN_IDS,
        }
