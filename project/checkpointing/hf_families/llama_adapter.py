"""Llama (``model_type`` llama) as this project's ``Llama``: RMSNorm, RoPE (with Llama 3's long-context scaling),
SwiGLU, grouped-query attention, each projection a tensor of its own. Its relatives (Mistral, Qwen 2, Qwen 3, Phi-3,
the mixtures) are this family with their differences, each in its own file."""

from typing import Any, ClassVar

import torch
from torch import nn

from project.checkpointing.hf_families.family import NO_TOKEN_IDS, HFFamily, variant
from project.models import Llama
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError


def rope(config: dict[str, Any]) -> tuple[float, dict | None]:
    """(theta, scaling) from a Llama config: ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``."""
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = parameters.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ConfigError(
            "model.init_from",
            f"uses RoPE scaling {kind!r}.",
            "use a model with Llama 3's RoPE scaling (rope_type llama3) or none.",
        )
    return theta, {
        "factor": parameters["factor"],
        "low_freq_factor": parameters["low_freq_factor"],
        "high_freq_factor": parameters["high_freq_factor"],
        "original_max_length": parameters["original_max_position_embeddings"],
    }


class LlamaFamily(HFFamily):
    model_type = "llama"
    model_group = "llama"
    net_class: ClassVar[type[BlockSequence]] = Llama
    architecture: ClassVar[str] = "LlamaForCausalLM"
    names = {
        "stem.tokens.weight": "model.embed_tokens.weight",
        "blocks.{i}.norm1.weight": "model.layers.{i}.input_layernorm.weight",
        "blocks.{i}.attention.{n}_norm.weight": "model.layers.{i}.self_attn.{n}_norm.weight",  # Qwen 3's
        "blocks.{i}.attention.{p}.weight": "model.layers.{i}.self_attn.{p}_proj.weight",
        "blocks.{i}.attention.{p}.bias": "model.layers.{i}.self_attn.{p}_proj.bias",  # Qwen 2's
        "blocks.{i}.norm2.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "blocks.{i}.mlp.{p}.weight": "model.layers.{i}.mlp.{p}_proj.weight",
        "head.norm.weight": "model.norm.weight",
        "head.output.weight": "lm_head.weight",
    }
    qkv_bias: ClassVar[bool] = False  # biases on the query, key and value projections (Qwen 2's)
    qk_norm: ClassVar[bool] = False  # each query and key head RMS-normalised (Qwen 3's)

    def net_options(self, config: dict[str, Any]) -> dict[str, Any]:
        heads = config["num_attention_heads"]
        # Qwen 2 always biases its query, key and value projections (no key says so); attention_bias, for Llama and
        # Qwen 3, would bias the output projection too, which no released model of theirs does.
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise variant("biases on every attention or MLP projection")
        if config.get("hidden_act", "silu") != "silu":
            raise variant(f"hidden_act {config['hidden_act']!r} (SwiGLU's silu only)")
        rope_settings = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if config.get("partial_rotary_factor", rope_settings.get("partial_rotary_factor", 1.0)) != 1.0:
            raise variant("RoPE on a part of each head (partial_rotary_factor, Phi-4-mini's)")
        if any(config.get(key) for key in ("resid_pdrop", "embd_pdrop", "attention_dropout")):
            raise variant("dropout (resid_pdrop, embd_pdrop, attention_dropout)")
        theta, scaling = rope(config)
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        return {
            "vocab_size": config["vocab_size"],
            "max_length": config["max_position_embeddings"],
            "num_layers": config["num_hidden_layers"],
            "dim": config["hidden_size"],
            "num_heads": heads,
            "num_kv_heads": config.get("num_key_value_heads") or heads,
            "hidden_dim": config["intermediate_size"],
            "rope_theta": theta,
            "rope_scaling": scaling,
            "norm_eps": config.get("rms_norm_eps", 1e-6),
            "tie_weights": self.is_tied(config),
            "head_dim": None if head_dim * heads == config["hidden_size"] else head_dim,  # null: hidden_size / heads
            "qkv_bias": self.qkv_bias,
            "qk_norm": self.qk_norm,
        }

    def writes(self, net: nn.Module, net_cfg: dict[str, Any]) -> bool:
        """A Llama of neither Qwen's options: a Mistral without its sliding window (which this project does not
        train) is a Llama to transformers, both computing the same."""
        return isinstance(net, Llama) and not net_cfg.get("qk_norm") and not net_cfg.get("qkv_bias")

    def hf_config(self, net_cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
        scaling = net_cfg.get("rope_scaling")
        rope_parameters = {"rope_type": "default", "rope_theta": net_cfg["rope_theta"]}
        if scaling:
            rope_parameters = {
                "rope_type": "llama3",
                "rope_theta": net_cfg["rope_theta"],
                "factor": scaling["factor"],
                "low_freq_factor": scaling["low_freq_factor"],
                "high_freq_factor": scaling["high_freq_factor"],
                "original_max_position_embeddings": scaling["original_max_length"],
            }
        return {
            "model_type": self.model_type,
            "architectures": [self.architecture],
            "vocab_size": net_cfg["vocab_size"],
            "max_position_embeddings": net_cfg["max_length"],
            "hidden_size": net_cfg["dim"],
            "intermediate_size": net_cfg["hidden_dim"],
            "num_hidden_layers": net_cfg["num_layers"],
            "num_attention_heads": net_cfg["num_heads"],
            "num_key_value_heads": net_cfg["num_kv_heads"],
            "head_dim": net_cfg.get("head_dim") or net_cfg["dim"] // net_cfg["num_heads"],
            "hidden_act": "silu",
            "rms_norm_eps": net_cfg["norm_eps"],
            "rope_theta": net_cfg["rope_theta"],
            "rope_scaling": rope_parameters if scaling else None,
            "rope_parameters": rope_parameters,
            "attention_bias": False,
            "mlp_bias": False,
            "use_sliding_window": False,  # Qwen's: every token attends to the whole context, as here
            "tie_word_embeddings": bool(net_cfg.get("tie_weights")),
            "torch_dtype": str(dtype).removeprefix("torch."),
            **NO_TOKEN_IDS,
        }
