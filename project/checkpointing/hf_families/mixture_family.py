"""What the mixture-of-experts families (Qwen 3 MoE, Mixtral) share as this project's ``MoE``: Llama's attention, a
router, and one tensor per expert and projection there, where this project stacks each projection over the experts
(its parameter ``blocks.{i}.mlp.experts.{p}``)."""

from abc import abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from project.checkpointing.hf_families.family import hydra_value, variant
from project.checkpointing.hf_families.llama_adapter import LlamaFamily
from project.models.moe import MoE
from project.options.errors import ConfigError

# Llama's attention (Qwen 3's with its norms): the names every mixture family shares.
ATTENTION = {name: key for name, key in LlamaFamily.names.items() if ".mlp." not in name}
# The mixture's options neither family computes, with the value they must keep; written, they would be lost.
UNSUPPORTED = {
    "first_dense_layers": 0,
    "router_scores": "softmax",
    "shared_expert_hidden_dim": None,
    "bias_update_rate": 0.0,  # a score bias chooses the experts: neither family has one
}


class MixtureFamily(LlamaFamily):
    net_class = MoE
    expert_width_key: ClassVar[str]  # the config's key of each expert's SwiGLU width

    @abstractmethod
    def normalizes_weights(self, config: dict[str, Any]) -> bool:
        """Whether the chosen experts' weights are renormalised to sum to 1."""

    @abstractmethod
    def experts_config(self, net_cfg: dict[str, Any]) -> dict[str, Any]:
        """The family's keys of its experts in ``config.json``."""

    def net_options(self, config: dict[str, Any]) -> dict[str, Any]:
        """Llama's attention (without Qwen 2's biases), and the experts."""
        if config.get("router_jitter_noise"):
            raise variant("noise on the router's logits (router_jitter_noise)")
        options = {key: value for key, value in super().net_options(config).items() if key != "qkv_bias"}
        # Qwen 3 MoE's published configs say num_experts; transformers 5 writes it as Mixtral's num_local_experts.
        experts = config["num_experts"] if "num_experts" in config else config["num_local_experts"]
        return {
            **options,
            "num_experts": experts,
            "experts_per_token": config["num_experts_per_tok"],
            "expert_hidden_dim": config[self.expert_width_key],
            "first_dense_layers": 0,
            "router_scores": "softmax",
            "normalize_weights": self.normalizes_weights(config),
            "shared_expert_hidden_dim": None,
        }

    def writes(self, net: nn.Module, net_cfg: dict[str, Any]) -> bool:
        return isinstance(net, MoE) and bool(net_cfg.get("qk_norm")) == self.qk_norm

    def hf_config(self, net_cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
        # (A capacity factor drops tokens in training only: the model computes as its family's, and exports.)
        for key, value in UNSUPPORTED.items():
            if net_cfg.get(key, value) != value:
                raise ConfigError(
                    f"model.net.{key}",
                    f"is {hydra_value(net_cfg[key])}, which no {self.model_type} model computes.",
                    "export a mixture of Qwen 3 MoE's or Mixtral's shape (model=moe's presets) or train one.",
                )
        experts = {"num_experts_per_tok": net_cfg["experts_per_token"], "output_router_logits": False}
        return {**super().hf_config(net_cfg, dtype), **experts, **self.experts_config(net_cfg)}
