"""Hugging Face model dirs (``config.json`` + safetensors) of the GPT-2, Llama, Mistral, Qwen 2, Qwen 3 and Phi-3
families, and of the mixtures of experts Qwen 3 MoE and Mixtral, in and out, offline. Llama's relatives are this
project's ``Llama`` with their options (``net_options``); the mixtures its ``MoE``.

In: ``model.init_from=<dir>`` gives the model that dir's weights instead of seeded ones. The config's shape keys
are checked against ``model.net`` before launch (``check_matches``), and each rank reads from the safetensors only
the part of each tensor it keeps (``HFWeights.read``): its FSDP shard's rows, its pipeline stages' tensors.

Out: ``python -m project.cli.export`` writes a checkpoint as such a dir (``write_hf_dir``), loadable by
``transformers.AutoModelForCausalLM.from_pretrained``.

Names are translated by a table per family (``NAMES``); GPT-2 stores its linear layers transposed (its
``Conv1D``), which ``TRANSPOSED`` lists, and its query, key and value projections as one (``c_attn``), of which
this project's ``q``, ``k`` and ``v`` are thirds (``FUSED``). A mixture's experts are one tensor per projection
here, stacked over the experts, and one per expert there (``EXPERTS``).
"""

import functools
import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from project.models import GPT, Llama
from project.models.lora import is_adapter
from project.models.moe import MoE
from project.options.errors import ConfigError
from project.options.writes import written

# This project's parameter name -> Hugging Face's, per family; {i} is a block index.
NAMES = {
    "gpt2": {
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
    },
}
# Phi-3: Llama's decoder with its query, key and value projections fused (qkv_proj), and its gate and up (FUSED).
NAMES["phi3"] = {
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
NAMES["llama"] = NAMES["mistral"] = NAMES["qwen2"] = NAMES["qwen3"] = {
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
# The mixtures of experts: Llama's attention (Qwen 3's with its norms), a router, and one tensor per expert and
# projection, where this project stacks each projection over the experts (its parameter blocks.{i}.mlp.experts.{p}).
_ATTENTION = {name: key for name, key in NAMES["llama"].items() if ".mlp." not in name}
NAMES["qwen3_moe"] = {**_ATTENTION, "blocks.{i}.mlp.router.weight": "model.layers.{i}.mlp.gate.weight"}
NAMES["mixtral"] = {**_ATTENTION, "blocks.{i}.mlp.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight"}
# Each family's name of expert {e}'s projection {p} in block {i}, and its projections' names.
EXPERTS = {
    "qwen3_moe": (
        "model.layers.{i}.mlp.experts.{e}.{p}.weight",
        {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
    ),
    "mixtral": ("model.layers.{i}.block_sparse_moe.experts.{e}.{p}.weight", {"gate": "w1", "up": "w3", "down": "w2"}),
}
EXPERT_PARAMETER = re.compile(r"^blocks\.(?P<i>\d+)\.mlp\.experts\.(?P<p>gate|up|down)$")
# The model group of each family's own preset files, for messages.
MODEL_GROUPS = {
    "gpt2": "gpt",
    "llama": "llama",
    "mistral": "mistral",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "moe",
    "mixtral": "moe",
}
TRANSPOSED = re.compile(r"h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
# Parameters stored as parts of one Hugging Face tensor, stacked along its output features in this order: GPT-2's
# c_attn is [query; key; value], as is Phi-3's qkv_proj (with fewer key/value rows under grouped-query attention),
# and Phi-3's gate_up_proj is [gate; up]. Separate here, so that tensor parallelism shards each by heads or units.
FUSED: dict[str, list[tuple[str, ...]]] = {"gpt2": [("q", "k", "v")], "phi3": [("q", "k", "v"), ("gate", "up")]}
FUSED_NAME = re.compile(r"\.(?:attention|mlp)\.(\w+)\.(?:weight|bias)$")
NET_CLASSES: dict[str, type[GPT] | type[Llama] | type[MoE]] = {
    "gpt2": GPT,
    **{family: Llama for family in ("llama", "mistral", "phi3", "qwen2", "qwen3")},
    **{family: MoE for family in EXPERTS},
}
# lm_head's source when tied
TIED_INPUT = {family: "model.embed_tokens.weight" for family in NET_CLASSES} | {"gpt2": "transformer.wte.weight"}


def _pattern(template: str) -> re.Pattern:
    pattern = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>\w+)")
    return re.compile(pattern.replace(r"\{n\}", r"(?P<n>[qk])") + "$")


def expert_keys(family: str, name: str, experts: range) -> list[str] | None:
    """The Hugging Face names of ``experts``' parts of this project's parameter ``name``, when it is a mixture's
    stacked expert projection; else None."""
    match = EXPERT_PARAMETER.match(name)
    if family not in EXPERTS or match is None:
        return None
    template, projections = EXPERTS[family]
    return [template.format(i=match["i"], e=e, p=projections[match["p"]]) for e in experts]


def hf_name(family: str, name: str) -> str:
    """The Hugging Face name of this project's parameter ``name``."""
    for ours, theirs in NAMES[family].items():
        match = _pattern(ours).match(name)
        if match:
            return theirs.format(**match.groupdict())
    raise KeyError(f"{name} has no Hugging Face name in the {family} family")


def read_config(path: str | Path) -> dict[str, Any]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            "model.init_from",
            f"{path} holds no config.json.",
            "pass a Hugging Face model dir (config.json and *.safetensors, as save_pretrained writes them).",
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(
            "model.init_from", f"{config_file} is not valid JSON ({error}).", "pass a complete Hugging Face model dir."
        ) from None
    if config.get("model_type") not in NAMES:
        raise ConfigError(
            "model.init_from",
            f"{path} holds a {config.get('model_type')!r} model.",
            f"use a model of the families {sorted(NAMES)} (model="
            + ", model=".join(sorted(MODEL_GROUPS.values()))
            + ").",
        )
    return config


def _rope(config: dict[str, Any]) -> tuple[float, dict | None]:
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


# GPT-2's GELU spellings in transformers: the exact one, and the tanh approximation under two names.
GPT2_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def is_tied(config: dict[str, Any]) -> bool:
    """Whether the model's output layer is its token embedding (transformers' default: GPT-2 yes, Llama no)."""
    return config.get("tie_word_embeddings", config["model_type"] == "gpt2")


def net_options(config: dict[str, Any]) -> dict[str, Any]:
    """The ``model.net`` options that give a Hugging Face config's model (the shape keys, by this project's name);
    ``ConfigError`` for a variant these models cannot compute."""
    try:
        if config["model_type"] == "gpt2":
            return _gpt2_options(config)
        return _moe_options(config) if config["model_type"] in EXPERTS else _llama_options(config)
    except KeyError as error:
        raise ConfigError(
            "model.init_from", f"its config.json has no {error}.", "pass a complete Hugging Face model dir."
        ) from None


def _variant(description: str) -> ConfigError:
    return ConfigError(
        "model.init_from",
        f"is a variant this project's model cannot compute: {description}.",
        "use a model of the standard shape of its family.",
    )


def _gpt2_options(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("n_inner") not in (None, 4 * config["n_embd"]) or config.get("layer_norm_epsilon", 1e-5) != 1e-5:
        raise _variant("an MLP width other than 4 x n_embd, or a LayerNorm epsilon other than 1e-5")
    if config.get("activation_function", "gelu_new") not in GPT2_GELU:
        raise _variant(f"activation_function {config['activation_function']!r} (GELU only)")
    if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx"):
        raise _variant("attention scores scaled otherwise than by 1/sqrt(head width)")
    return {
        "vocab_size": config["vocab_size"],
        "max_length": config["n_positions"],
        "num_layers": config["n_layer"],
        "dim": config["n_embd"],
        "num_heads": config["n_head"],
        "tie_weights": is_tied(config),
        "gelu_approximate": GPT2_GELU[config.get("activation_function", "gelu_new")],
    }


def sliding_window(config: dict[str, Any]) -> int | None:
    """The attention window of a Mistral or Qwen config, as transformers reads it (Mistral's default 4,096 when the
    key is absent; Qwen's only under ``use_sliding_window``); None: every token sees the whole context."""
    if config["model_type"] == "mistral":
        return config.get("sliding_window", 4096)
    if config["model_type"] in ("phi3", "mixtral"):
        return config.get("sliding_window")
    if config["model_type"] in ("qwen2", "qwen3", "qwen3_moe") and config.get("use_sliding_window"):
        return config.get("sliding_window", 4096)
    return None


def _llama_options(config: dict[str, Any]) -> dict[str, Any]:
    family, heads = config["model_type"], config["num_attention_heads"]
    # Qwen 2 always biases its query, key and value projections (no key says so); attention_bias, for Llama and
    # Qwen 3, would bias the output projection too, which no released model of theirs does.
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise _variant("biases on every attention or MLP projection")
    if config.get("hidden_act", "silu") != "silu":
        raise _variant(f"hidden_act {config['hidden_act']!r} (SwiGLU's silu only)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise _variant("RoPE on a part of each head (partial_rotary_factor, Phi-4-mini's)")
    if any(config.get(key) for key in ("resid_pdrop", "embd_pdrop", "attention_dropout")):
        raise _variant("dropout (resid_pdrop, embd_pdrop, attention_dropout)")
    theta, scaling = _rope(config)
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
        "tie_weights": is_tied(config),
        "head_dim": None if head_dim * heads == config["hidden_size"] else head_dim,  # null: hidden_size / heads
        "qkv_bias": family == "qwen2",
        "qk_norm": family == "qwen3",
    }


def _moe_options(config: dict[str, Any]) -> dict[str, Any]:
    """A Qwen 3 MoE or Mixtral config's options: Llama's attention (without Qwen 2's biases), and its experts."""
    family = config["model_type"]
    if family == "qwen3_moe" and (config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1):
        raise _variant("dense blocks among the mixtures (mlp_only_layers, decoder_sparse_step)")
    if config.get("router_jitter_noise"):
        raise _variant("noise on the router's logits (router_jitter_noise)")
    options = {key: value for key, value in _llama_options(config).items() if key != "qkv_bias"}
    # Qwen 3 MoE's published configs say num_experts; transformers 5 writes it as Mixtral's num_local_experts.
    experts = config["num_experts"] if "num_experts" in config else config["num_local_experts"]
    width = config["moe_intermediate_size"] if family == "qwen3_moe" else config["intermediate_size"]
    return {
        **options,
        "qk_norm": family == "qwen3_moe",
        "num_experts": experts,
        "experts_per_token": config["num_experts_per_tok"],
        "expert_hidden_dim": width,
        "first_dense_layers": 0,
        "router_scores": "softmax",
        "normalize_weights": config.get("norm_topk_prob", False) if family == "qwen3_moe" else True,
        "shared_expert_hidden_dim": None,
    }


def _hydra_value(value: Any) -> str:
    """``value`` as a command-line override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{_hydra_value(item)}" for key, item in value.items()) + "}"
    return str(value)


def check_matches(path: str | Path, net: nn.Module, net_cfg: dict[str, Any]) -> None:
    """``ConfigError`` naming the first ``model.net`` key whose value differs from the Hugging Face model's."""
    config = read_config(path)
    family = config["model_type"]
    if not isinstance(net, NET_CLASSES[family]):
        raise ConfigError(
            "model.init_from",
            f"is a {family} model, but model.net is a {type(net).__name__}.",
            f"use model={MODEL_GROUPS[family]} (or one of its presets).",
        )
    window = sliding_window(config)
    if window is not None and net_cfg.get("max_length", 0) > window:
        raise ConfigError(
            "data.seq_length",
            f"is {net_cfg.get('max_length')}, longer than the {window}-token attention window of {path}'s model, "
            "which this project's attention (every token sees all before it) does not restrict.",
            f"use data.seq_length={window} or less: within its window the two compute the same.",
        )
    for key, value in net_options(config).items():
        if key == "max_length":  # the context it was trained for; GPT-2's position table holds only so many
            if family == "gpt2" and net_cfg.get(key, 0) > value:
                raise ConfigError(
                    "data.seq_length",
                    f"is {net_cfg.get(key)}, longer than the {value} positions of {path}'s position table.",
                    f"use data.seq_length={value} or less.",
                )
        elif key == "tie_weights" and value and not net_cfg.get(key):
            continue  # untied here (model_parallel, pipeline): the output layer starts as a copy of the embedding
        elif net_cfg.get(key) != value:
            raise ConfigError(
                f"model.net.{key}",
                f"is {_hydra_value(net_cfg.get(key))}, but {path}/config.json gives {_hydra_value(value)}.",
                f"set model.net.{key}={_hydra_value(value)}"
                + (
                    " (the data's vocabulary: prepare it with the model's tokenizer.json)."
                    if key == "vocab_size"
                    else ", or use the preset of that model's shape."
                ),
            )


def _fused_part(family: str, name: str) -> tuple[int, tuple[str, ...]] | None:
    """(its place, the parts in order) when ``name`` is a part of a fused Hugging Face tensor (``FUSED``)."""
    match = FUSED_NAME.search(name)
    layer = match.group(1) if match else None
    return next(((parts.index(layer), parts) for parts in FUSED.get(family, []) if layer in parts), None)


def _part_rows(config: dict[str, Any]) -> dict[str, int]:
    """The rows of each part of a fused tensor, from the model's config."""
    if config["model_type"] == "gpt2":
        return dict.fromkeys("qkv", config["n_embd"])
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


def _local_slices(parameter: torch.Tensor, row_offset: int = 0) -> tuple[slice, ...]:
    """The part of the saved tensor this rank holds: the parameter's shape from the start (a GPT-2 position table
    cut to the sequence length trained here), or its shard of it (a DTensor); within a fused tensor, rows of the
    parameter's own part, from ``row_offset``."""
    shape: Sequence[int]
    offset: Sequence[int]
    if isinstance(parameter, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            parameter.shape, parameter.device_mesh, parameter.placements
        )
    else:
        shape, offset = parameter.shape, [0] * parameter.dim()
    offset = [offset[0] + row_offset, *offset[1:]]
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


class HFWeights:
    """Reads this project's parameters from a Hugging Face model dir, each rank only the part it holds."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        config = read_config(path)
        self.family, self.tied = config["model_type"], is_tied(config)
        self.part_rows = _part_rows(config) if self.family in FUSED else {}
        index = self.path / "model.safetensors.index.json"  # a model saved in several files
        if index.is_file():
            self.files = {key: self.path / file for key, file in json.loads(index.read_text())["weight_map"].items()}
        else:
            with safe_open(self.path / "model.safetensors", "pt") as file:
                # safe_open's handle is no dict: keys() is its only listing
                self.files = {key: self.path / "model.safetensors" for key in file.keys()}  # noqa: SIM118

    def _key(self, name: str) -> str:
        key = hf_name(self.family, name)
        if key == "lm_head.weight" and self.tied and key not in self.files:  # tied: saved once, as the embedding
            key = TIED_INPUT[self.family]
        if key not in self.files:
            key = key.removeprefix("transformer.")  # GPT-2 as first published: no "transformer." prefix
        return key

    def missing(self, net: nn.Module) -> list[str]:
        """The Hugging Face names of ``net``'s parameters this dir does not hold (or whose file is absent); LoRA's
        adapters, which start from the seed, are none of them."""
        missing = []
        for name, parameter in net.named_parameters():
            if is_adapter(name):
                continue
            keys = expert_keys(self.family, name, range(parameter.shape[0])) or [self._key(name)]
            missing += [key for key in keys if key not in self.files or not self.files[key].is_file()]
        return missing

    def read(self, name: str, parameter: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter ``name`` (its local shape), in float32 on the CPU."""
        slices = _local_slices(parameter)
        keys = expert_keys(self.family, name, range(slices[0].start, slices[0].stop))
        if keys == []:  # an FSDP rank past the last expert (fewer experts than ranks) holds none
            return torch.empty([s.stop - s.start for s in slices])
        if keys is not None:  # a mixture's projection, stacked over the experts: this rank's experts' tensors
            experts = []
            for key in keys:
                with safe_open(self.files[key], "pt") as file:
                    experts.append(file.get_slice(key)[slices[1:]])
            return torch.stack(experts).float().contiguous()
        key = self._key(name)
        part = _fused_part(self.family, name)
        row_offset = sum(self.part_rows[earlier] for earlier in part[1][: part[0]]) if part else 0
        slices = _local_slices(parameter, row_offset)
        transposed = TRANSPOSED.search(key) is not None
        with safe_open(self.files[key], "pt") as file:
            value = file.get_slice(key)[slices[::-1] if transposed else slices]
        return (value.T if transposed else value).float().contiguous()


@functools.lru_cache(maxsize=8)  # a run saves many checkpoints of one base
def weights_fingerprint(path: str | Path) -> str:
    """A short hash of a Hugging Face model dir's weights: its config.json, and each tensor's name, type, shape and
    first row (reading a few values per tensor, not gigabytes). Two dirs of other weights differ in it."""
    digest = hashlib.sha256(Path(path, "config.json").read_bytes())
    weights = HFWeights(path)
    for key in sorted(weights.files):
        with safe_open(weights.files[key], "pt") as file:
            piece = file.get_slice(key)
            first = piece[:1] if piece.get_shape() else piece[:]
        digest.update(f"{key} {piece.get_dtype()} {piece.get_shape()}".encode())
        digest.update(first.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


# What an export that cannot write its files stops with, after the path and the cause.
EXPORT_AGAIN = "The export stopped; nothing half-written is left in it. Free space on that disk, then export again."


def write_hf_dir(
    state_dict: dict[str, torch.Tensor],
    net: nn.Module,
    net_cfg: dict[str, Any],
    out: str | Path,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``state_dict`` (of ``net``, built from ``net_cfg``) as a Hugging Face model dir: config.json and
    model.safetensors. A tied output layer is saved once, as transformers expects."""
    family = export_family(net, net_cfg)
    config = _hf_config(family, net_cfg, dtype)  # first: it refuses a model its family cannot hold
    tied = bool(net_cfg.get("tie_weights"))
    parts: dict[str, list[torch.Tensor | None]] = {}  # a fused tensor's parts, in order
    for name, value in state_dict.items():
        keys = expert_keys(family, name, range(value.shape[0]) if value.dim() else range(0))
        if keys is not None:  # a mixture's projection: one tensor per expert
            parts.update({key: [expert] for key, expert in zip(keys, value)})
            continue
        key = hf_name(family, name)
        if tied and key == "lm_head.weight":
            continue
        part = _fused_part(family, name)
        index, count = (part[0], len(part[1])) if part is not None else (0, 1)
        parts.setdefault(key, [None] * count)[index] = value
    tensors = {}
    for key, values in parts.items():
        value = torch.cat(cast(list[torch.Tensor], values))  # a whole state dict holds every part
        value = value.T if TRANSPOSED.search(key) else value
        tensors[key] = value.to(dtype).contiguous()
    out = Path(out)
    with written(out / "model.safetensors", "weights", EXPORT_AGAIN) as partial:
        try:
            save_file(tensors, partial, metadata={"format": "pt"})
        except SafetensorError as error:  # the library's own type for its I/O errors, the OS's code in the text
            code = re.search(r"os error (\d+)", str(error))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1)))) from error
    with written(out / "config.json", "config", EXPORT_AGAIN) as partial:
        partial.write_text(json.dumps(config, indent=2) + "\n")
    return out


def export_family(net: nn.Module, net_cfg: dict[str, Any]) -> str:
    """The Hugging Face family a model is written as: GPT-2 for a GPT; for a mixture of experts, Qwen 3 MoE with
    per-head query and key norms, else Mixtral; for a Llama, Qwen 3 with per-head query and key norms, Qwen 2 with
    query, key and value biases, else Llama (a Mistral without its sliding window, which this project does not
    train, is a Llama to transformers: both compute the same)."""
    if isinstance(net, GPT):
        return "gpt2"
    if isinstance(net, MoE):  # Qwen 3 MoE has Qwen 3's norms; Mixtral none
        return "qwen3_moe" if net_cfg.get("qk_norm") else "mixtral"
    return "qwen3" if net_cfg.get("qk_norm") else "qwen2" if net_cfg.get("qkv_bias") else "llama"


# The special tokens are the tokenizer's business, which this project does not know: without these nulls,
# transformers would take its family defaults (GPT-2's 50256, Llama's 1 and 2) and stop generating at them.
NO_TOKEN_IDS = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _hf_config(family: str, net_cfg: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    dtype_name = str(dtype).removeprefix("torch.")
    if family == "gpt2":
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
            "torch_dtype": dtype_name,
            **NO_TOKEN_IDS,
        }
    scaling = net_cfg.get("rope_scaling")
    rope = {"rope_type": "default", "rope_theta": net_cfg["rope_theta"]}
    if scaling:
        rope = {
            "rope_type": "llama3",
            "rope_theta": net_cfg["rope_theta"],
            "factor": scaling["factor"],
            "low_freq_factor": scaling["low_freq_factor"],
            "high_freq_factor": scaling["high_freq_factor"],
            "original_max_position_embeddings": scaling["original_max_length"],
        }
    architecture = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
    }[family]
    return {
        "model_type": family,
        "architectures": [architecture],
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
        "rope_scaling": rope if scaling else None,
        "rope_parameters": rope,
        "attention_bias": False,
        "mlp_bias": False,
        "use_sliding_window": False,  # Qwen's: every token attends to the whole context, as here
        "tie_word_embeddings": bool(net_cfg.get("tie_weights")),
        "torch_dtype": dtype_name,
        **NO_TOKEN_IDS,
        **(_experts_config(family, net_cfg) if family in EXPERTS else {}),
    }


def _experts_config(family: str, net_cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture's keys of its config.json. ``ConfigError`` for options its family does not compute."""
    # (A capacity factor drops tokens in training only: the model computes as its family's, and exports.)
    unsupported = {
        "first_dense_layers": 0,
        "router_scores": "softmax",
        "shared_expert_hidden_dim": None,
        "bias_update_rate": 0.0,  # a score bias chooses the experts: neither family has one
    }
    for key, value in unsupported.items():
        if net_cfg.get(key, value) != value:
            raise ConfigError(
                f"model.net.{key}",
                f"is {_hydra_value(net_cfg[key])}, which no {family} model computes.",
                "export a mixture of Qwen 3 MoE's or Mixtral's shape (model=moe's presets) or train one.",
            )
    if family == "mixtral" and not net_cfg.get("normalize_weights", True):
        raise ConfigError(
            "model.net.normalize_weights", "is false; Mixtral renormalises its experts' weights.", "set it true."
        )
    experts = {"num_experts_per_tok": net_cfg["experts_per_token"], "output_router_logits": False}
    if family == "mixtral":
        return {
            **experts,
            "num_local_experts": net_cfg["num_experts"],
            "intermediate_size": net_cfg["expert_hidden_dim"],
        }
    return {
        **experts,
        "num_experts": net_cfg["num_experts"],
        "moe_intermediate_size": net_cfg["expert_hidden_dim"],
        "norm_topk_prob": net_cfg.get("normalize_weights", True),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
