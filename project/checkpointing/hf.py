"""Hugging Face model dirs (``config.json`` + safetensors) in and out, offline, for every family of
``project.checkpointing.hf_families`` (GPT-2, Llama, Mistral, Qwen 2, Qwen 3 and Phi-3, and the mixtures of experts
Qwen 3 MoE and Mixtral): each family's names, fused and transposed tensors and config are its adapter's; what they
all share is here.

In: ``model.init_from=<dir>`` gives the model that dir's weights instead of seeded ones. The config's shape keys
are checked against ``model.net`` before launch (``check_matches``), and each rank reads from the safetensors only
the part of each tensor it keeps (``HFWeights.read``): its FSDP shard's rows, its pipeline stages' tensors.

Out: ``python -m project.cli.export`` writes a checkpoint as such a dir (``write_hf_dir``), loadable by
``transformers.AutoModelForCausalLM.from_pretrained``.
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

from project.checkpointing.hf_families import FAMILIES, HFFamily
from project.checkpointing.hf_families.family import hydra_value
from project.models.lora import is_adapter
from project.options.errors import ConfigError
from project.options.writes import written

# The net classes a model dir can be read into.
NET_CLASSES = tuple({family.net_class for family in FAMILIES.values()})


def hf_name(model_type: str, name: str) -> str:
    """The Hugging Face name of this project's parameter ``name`` in the family ``model_type``."""
    return FAMILIES[model_type].hf_name(name)


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
    if config.get("model_type") not in FAMILIES:
        groups = sorted({family.model_group for family in FAMILIES.values()})
        raise ConfigError(
            "model.init_from",
            f"{path} holds a {config.get('model_type')!r} model.",
            f"use a model of the families {sorted(FAMILIES)} (model=" + ", model=".join(groups) + ").",
        )
    return config


def family_of(config: dict[str, Any]) -> HFFamily:
    """The adapter of ``config``'s family (``read_config`` has checked there is one)."""
    return FAMILIES[config["model_type"]]


def net_options(config: dict[str, Any]) -> dict[str, Any]:
    """The ``model.net`` options that give a Hugging Face config's model (the shape keys, by this project's name);
    ``ConfigError`` for a variant these models cannot compute."""
    try:
        return family_of(config).net_options(config)
    except KeyError as error:
        raise ConfigError(
            "model.init_from", f"its config.json has no {error}.", "pass a complete Hugging Face model dir."
        ) from None


# The model.net options that tell one family's models from another's with the same net class (Qwen 2's query, key
# and value biases, Qwen 3's query and key norms): the model group's own, never read from a model dir, so that a dir
# of another family is refused rather than trained under the group's name.
FAMILY_KEYS = ("qkv_bias", "qk_norm")


def check_matches(path: str | Path, net: nn.Module, net_cfg: dict[str, Any]) -> None:
    """``ConfigError`` naming the first ``model.net`` key whose value differs from the Hugging Face model's (for a
    ``FAMILY_KEYS`` one, the family to use)."""
    config = read_config(path)
    family = family_of(config)
    if not isinstance(net, family.net_class):
        raise ConfigError(
            "model.init_from",
            f"is a {family.model_type} model, but model.net is a {type(net).__name__}.",
            f"use model={family.model_group} (or one of its presets).",
        )
    window = family.sliding_window(config)
    if window is not None and net_cfg.get("max_length", 0) > window:
        raise ConfigError(
            "data.seq_length",
            f"is {net_cfg.get('max_length')}, longer than the {window}-token attention window of {path}'s model, "
            "which this project's attention (every token sees all before it) does not restrict.",
            f"use data.seq_length={window} or less: within its window the two compute the same.",
        )
    options = net_options(config)
    for key in FAMILY_KEYS:  # first: another family's dir is wrong whatever its shape
        if key in options and bool(net_cfg.get(key)) != bool(options[key]):
            raise ConfigError(
                "model.init_from",
                f"is a {family.model_type} model ({key} {hydra_value(options[key])}), but model.net computes another "
                f"family's ({key} {hydra_value(net_cfg.get(key))}).",
                f"use model={family.model_group} (or one of its presets) with this dir.",
            )
    for key, value in options.items():
        if key == "max_length":  # the context it was trained for; GPT-2's position table holds only so many
            if family.position_table and net_cfg.get(key, 0) > value:
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
                f"is {hydra_value(net_cfg.get(key))}, but {path}/config.json gives {hydra_value(value)}.",
                f"set model.net.{key}={hydra_value(value)}"
                + (
                    " (the data's vocabulary: prepare it with the model's tokenizer.json)."
                    if key == "vocab_size"
                    else ", or use the preset of that model's shape."
                ),
            )


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
        self.family = family_of(config)
        self.tied, self.part_rows = self.family.is_tied(config), self.family.part_rows(config)
        index = self.path / "model.safetensors.index.json"  # a model saved in several files
        if index.is_file():
            self.files = {key: self.path / file for key, file in json.loads(index.read_text())["weight_map"].items()}
        else:
            with safe_open(self.path / "model.safetensors", "pt") as file:
                # safe_open's handle is no dict: keys() is its only listing
                self.files = {key: self.path / "model.safetensors" for key in file.keys()}  # noqa: SIM118

    def _key(self, name: str) -> str:
        key = self.family.hf_name(name)
        if key == "lm_head.weight" and self.tied and key not in self.files:  # tied: saved once, as the embedding
            key = self.family.tied_input
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
            keys = self.family.expert_keys(name, range(parameter.shape[0])) or [self._key(name)]
            missing += [key for key in keys if key not in self.files or not self.files[key].is_file()]
        return missing

    def read(self, name: str, parameter: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter ``name`` (its local shape), in float32 on the CPU."""
        slices = _local_slices(parameter)
        keys = self.family.expert_keys(name, range(slices[0].start, slices[0].stop))
        if keys == []:  # an FSDP rank past the last expert (fewer experts than ranks) holds none
            return torch.empty([s.stop - s.start for s in slices])
        if keys is not None:  # a mixture's projection, stacked over the experts: this rank's experts' tensors
            experts = []
            for key in keys:
                with safe_open(self.files[key], "pt") as file:
                    experts.append(file.get_slice(key)[slices[1:]])
            return torch.stack(experts).float().contiguous()
        key = self._key(name)
        part = self.family.fused_part(name)
        row_offset = sum(self.part_rows[earlier] for earlier in part[1][: part[0]]) if part else 0
        slices = _local_slices(parameter, row_offset)
        transposed = self.family.is_transposed(key)
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
    config = family.hf_config(net_cfg, dtype)  # first: it refuses a model its family cannot hold
    tied = bool(net_cfg.get("tie_weights"))
    parts: dict[str, list[torch.Tensor | None]] = {}  # a fused tensor's parts, in order
    for name, value in state_dict.items():
        keys = family.expert_keys(name, range(value.shape[0]) if value.dim() else range(0))
        if keys is not None:  # a mixture's projection: one tensor per expert
            parts.update({key: [expert] for key, expert in zip(keys, value)})
            continue
        key = family.hf_name(name)
        if tied and key == "lm_head.weight":
            continue
        part = family.fused_part(name)
        index, count = (part[0], len(part[1])) if part is not None else (0, 1)
        parts.setdefault(key, [None] * count)[index] = value
    tensors = {}
    for key, values in parts.items():
        value = torch.cat(cast(list[torch.Tensor], values))  # a whole state dict holds every part
        value = value.T if family.is_transposed(key) else value
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


def export_family(net: nn.Module, net_cfg: dict[str, Any]) -> HFFamily:
    """The Hugging Face family a model is written as (the one whose adapter ``writes`` it): GPT-2 for a GPT; for a
    mixture of experts, Qwen 3 MoE with per-head query and key norms, else Mixtral; for a Llama, Qwen 3 with per-head
    query and key norms, Qwen 2 with query, key and value biases, else Llama."""
    return next(family for family in FAMILIES.values() if family.writes(net, net_cfg))
