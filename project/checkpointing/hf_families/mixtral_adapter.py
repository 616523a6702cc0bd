"""Mixtral (``model_type`` mixtral): Llama's attention, a mixture in every block, its router
``block_sparse_moe.gate``, its experts ``block_sparse_moe.experts.{e}.w1, w3, w2`` (gate, up, down), the chosen
experts' weights always renormalised."""

from typing import Any

from project.checkpointing.hf_families.mixture_family import ATTENTION, MixtureFamily
from project.options.errors import ConfigError


class MixtralFamily(MixtureFamily):
    model_type = "mixtral"
    model_group = "mixtral_8x7b"  # model=moe is Qwen 3 MoE's (per-head query and key norms), which Mixtral has not
    architecture = "MixtralForCausalLM"
    names = {**ATTENTION, "blocks.{i}.mlp.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight"}
    experts = ("model.layers.{i}.block_sparse_moe.experts.{e}.{p}.weight", {"gate": "w1", "up": "w3", "down": "w2"})
    expert_width_key = "intermediate_size"

    def normalizes_weights(self, config: dict[str, Any]) -> bool:
        return True

    def sliding_window(self, config: dict[str, Any]) -> int | None:
        return config.get("sliding_window")

    def experts_config(self, net_cfg: dict[str, Any]) -> dict[str, Any]:
        if not net_cfg.get("normalize_weights", True):
            raise ConfigError(
                "model.net.normalize_weights", "is false; Mixtral renormalises its experts' weights.", "set it true."
            )
        return {"num_local_experts": net_cfg["num_experts"], "intermediate_size": net_cfg["expert_hidden_dim"]}
