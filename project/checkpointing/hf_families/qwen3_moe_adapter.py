"""Qwen 3 MoE (``model_type`` qwen3_moe): Qwen 3's attention with its per-head norms, a mixture in every block (no
dense blocks between), its router ``mlp.gate``, its experts ``mlp.experts.{e}.{gate,up,down}_proj``."""

from typing import Any

from project.checkpointing.hf_families.family import variant
from project.checkpointing.hf_families.mixture_family import ATTENTION, MixtureFamily
from project.checkpointing.hf_families.qwen2_adapter import qwen_sliding_window


class Qwen3MoEFamily(MixtureFamily):
    model_type = "qwen3_moe"
    model_group = "moe"
    architecture = "Qwen3MoeForCausalLM"
    names = {**ATTENTION, "blocks.{i}.mlp.router.weight": "model.layers.{i}.mlp.gate.weight"}
    experts = (
        "model.layers.{i}.mlp.experts.{e}.{p}.weight",
        {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    )
    qk_norm = True
    expert_width_key = "moe_intermediate_size"

    def net_options(self, config: dict[str, Any]) -> dict[str, Any]:
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            raise variant("dense blocks among the mixtures (mlp_only_layers, decoder_sparse_step)")
        return super().net_options(config)

    def normalizes_weights(self, config: dict[str, Any]) -> bool:
        return config.get("norm_topk_prob", False)

    def sliding_window(self, config: dict[str, Any]) -> int | None:
        return qwen_sliding_window(config)

    def experts_config(self, net_cfg: dict[str, Any]) -> dict[str, Any]:
        return {
            "num_experts": net_cfg["num_experts"],
            "moe_intermediate_size": net_cfg["expert_hidden_dim"],
            "norm_topk_prob": net_cfg.get("normalize_weights", True),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
