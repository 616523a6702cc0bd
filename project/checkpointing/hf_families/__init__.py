"""The Hugging Face families this project reads and writes, one adapter a file (``HFFamily``), by ``model_type``."""

from project.checkpointing.hf_families.family import HFFamily
from project.checkpointing.hf_families.gpt2_adapter import GPT2Family
from project.checkpointing.hf_families.llama_adapter import LlamaFamily
from project.checkpointing.hf_families.mistral_adapter import MistralFamily
from project.checkpointing.hf_families.mixtral_adapter import MixtralFamily
from project.checkpointing.hf_families.phi3_adapter import Phi3Family
from project.checkpointing.hf_families.qwen2_adapter import Qwen2Family
from project.checkpointing.hf_families.qwen3_adapter import Qwen3Family
from project.checkpointing.hf_families.qwen3_moe_adapter import Qwen3MoEFamily

FAMILIES: dict[str, HFFamily] = {
    family.model_type: family
    for family in (
        GPT2Family(),
        LlamaFamily(),
        MistralFamily(),
        Phi3Family(),
        Qwen2Family(),
        Qwen3Family(),
        Qwen3MoEFamily(),
        MixtralFamily(),
    )
}

__all__ = ["FAMILIES", "HFFamily"]
