"""``model.lora``: LoRA fine-tuning (``project.models.lora``): low-rank adapters beside chosen Linear layers of the
blocks, every other weight frozen; with ``quantize_base``, QLoRA: the frozen Linear weights of the blocks stored in
4-bit NF4 (``project.models.nf4``). Off at rank 0: every weight trains.

Its checkpoints hold the adapters alone (the frozen base is what every run of the config builds again: the weights
of ``model.init_from``, or the seeded ones) and name the base they were trained on (``lora_base``), so that a
resumed run, ``export`` and ``generate`` never put them on another.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from torch import nn

from project.checkpointing.hf import weights_fingerprint
from project.job.job import Job
from project.job.model_option import InitialWeights, ModelOption
from project.models.lora import LoRA, LoRALinear, apply_lora
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.options.option_types import NonNegativeInt, PositiveFloat, Probability

# Lightning's true half precisions convert every weight of the model to their dtype.
CONVERTING_PRECISIONS = ("bf16-true", "16-true")


@dataclass
class LoRAFineTuning(ModelOption):
    """Adapters of ``rank`` (0: none) on the blocks' Linear layers named in ``targets`` (``q``, ``v``...), their
    update scaled by ``alpha / rank``, ``dropout`` on their input; ``quantize_base``: the frozen Linear weights of
    the blocks in NF4 (QLoRA)."""

    rank: NonNegativeInt = 0
    alpha: PositiveFloat = 16.0
    dropout: Probability = 0.0
    targets: Sequence[str] = ("q", "v")
    quantize_base: bool = False
    trained: int = field(default=0, init=False)  # the parameters trained and in all, once built (the whole model)
    total: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.quantize_base and not self.rank:  # QLoRA asked for, and no adapters: every weight would train
            raise ConfigError(
                "model.lora.quantize_base",
                "is true, but model.lora.rank is 0: no adapters, so no frozen base to store in NF4.",
                "give the adapters a rank (model.lora.rank=16, say; experiment=qlora sets one), or set "
                "model.lora.quantize_base=false.",
            )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def adapters(self) -> LoRA:
        """The adapters ``project.models.lora`` puts on the net."""
        return LoRA(self.rank, float(self.alpha), float(self.dropout), tuple(self.targets), self.quantize_base)

    def problem(self, job: Job, net: BlockSequence) -> ConfigError | None:
        """An NF4 base is not split over tensor-parallel ranks, nor wrapped by FSDP over one rank (to offload it),
        nor converted by a true half precision."""
        if not self.quantize_base:
            return None
        if job.layout.wraps_one_rank(job):
            # FSDP2's one-rank path (FSDPParamGroup.wait_for_unshard, torch 2.11 to 2.13) takes a weight's first
            # all-gather input only; torchao's NF4 weight gathers three (codes, block scales, their scales). A
            # pipeline shards its stages only over 2 or more data-parallel ranks.
            return ConfigError(
                "model.lora.quantize_base",
                f"stores the base in NF4, which strategy={job.strategy_name} cannot shard over one data-parallel "
                "rank: torch's FSDP2 gathers one tensor a weight there, and an NF4 weight is three.",
                "set strategy.cpu_offload=false (FSDP over one rank then leaves the model unwrapped), or give FSDP "
                "2 or more data-parallel ranks (trainer.devices).",
            )
        if job.dims.tensor_parallel > 1:
            return ConfigError(
                "model.lora.quantize_base",
                f"stores the base in NF4, which {job.dims.tensor_parallel} tensor-parallel ranks "
                "(strategy.tensor_parallel_size) cannot split: torchao's NF4 splits only by rows, in whole blocks.",
                "set strategy.tensor_parallel_size=1 (FSDP shards NF4 weights), or model.lora.quantize_base=false.",
            )
        if job.precision in CONVERTING_PRECISIONS:
            return ConfigError(
                "trainer.precision",
                f"is {job.precision}, which converts every weight to {job.precision[:-5]}, the NF4 base "
                "(model.lora.quantize_base) too.",
                "use trainer.precision=bf16-mixed (QLoRA's own: the adapters in float32, the matmuls in bfloat16).",
            )
        return None

    def build(self, net: BlockSequence) -> None:
        """The adapters on each target of the blocks (of any block: a mixture's dense first blocks and its later
        ones have other layers), every other weight frozen; ``ConfigError`` for a target no block has."""
        linear = sorted(
            {name.rpartition(".")[2] for name, module in net.blocks.named_modules() if isinstance(module, nn.Linear)}
        )
        if not self.targets:
            raise ConfigError("model.lora.targets", "is empty.", f"give a list of layer names, e.g. [q, v]: {linear}.")
        unknown = [target for target in self.targets if target not in linear]
        if unknown:
            raise ConfigError(
                "model.lora.targets",
                f"names {unknown}, which are not Linear layers of {type(net).__name__}'s blocks.",
                f"choose among {linear}.",
            )
        apply_lora(net, self.adapters)
        self.trained = sum(parameter.numel() for parameter in net.parameters() if parameter.requires_grad)
        self.total = sum(parameter.numel() for parameter in net.parameters())

    def notice(self, net: BlockSequence) -> str | None:
        """Adapter keys set with no rank (they do nothing: every weight trains), or a rank above the width of a layer
        it adapts (that layer's update can be of its width's rank at most, for more parameters than the layer)."""
        if not self.enabled:
            defaults = {item.name: item.default for item in fields(self) if item.init and item.name != "rank"}
            changed = [name for name, default in defaults.items() if _differs(getattr(self, name), default)]
            if not changed:
                return None
            keys = ", ".join(f"model.lora.{name}" for name in changed)
            return (
                f"model.lora.rank is 0: no adapters, so {keys} {'does' if len(changed) == 1 else 'do'} nothing and "
                "every weight trains. Give the adapters a rank (model.lora.rank=16) for LoRA."
            )
        widths = [
            min(layer.in_features, layer.out_features) for layer in net.modules() if isinstance(layer, LoRALinear)
        ]
        narrower = [width for width in widths if width < self.rank]
        if not narrower:
            return None
        return (
            f"model.lora.rank={self.rank} is above the width of {len(narrower)} of the {len(widths)} layers it adapts "
            f"(the narrowest: {min(narrower)}, the smaller of its input and output): such a layer's update has rank "
            f"{min(narrower)} at most, and its adapters hold more parameters than the layer. Use model.lora.rank="
            f"{min(widths)} or less (LoRA's usual: 8 to 64)."
        )

    def summary(self) -> str:
        frozen = "frozen, the blocks' Linear weights in 4-bit NF4" if self.quantize_base else "frozen"
        return (
            f"LoRA (rank {self.rank} on {', '.join(self.targets)}): training {self.trained:,} of {self.total:,} "
            f"parameters ({self.trained / self.total:.2%}); the rest {frozen}."
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any], weights: InitialWeights) -> None:
        checkpoint["lora_base"] = self.base(weights)  # what its adapters were trained on: not in the checkpoint

    def on_load_checkpoint(self, checkpoint: dict[str, Any], weights: InitialWeights) -> None:
        self.check_base(checkpoint.get("lora_base"), weights)

    def base(self, weights: InitialWeights) -> str:
        """What the frozen base is: the fingerprint of ``model.init_from``'s weights, or the seed drawing it, and
        whether it is stored in NF4 (QLoRA's adapters learn to correct the quantized weights)."""
        init_from = weights.init_from
        base = f"weights {weights_fingerprint(init_from)}" if init_from else f"seed {weights.seed}"
        return f"{base} in NF4" if self.quantize_base else base

    def check_base(self, saved: str | None, weights: InitialWeights) -> None:
        """``ConfigError`` when the base a checkpoint's adapters were trained on (``saved``) is not this one, or is
        gone."""
        if weights.init_from and not Path(weights.init_from, "config.json").is_file():
            raise ConfigError(
                "model.init_from",
                f"is {weights.init_from}, which holds no model now: the checkpoint holds the adapters alone, trained "
                f"on the base there{f' ({saved})' if saved else ''}.",
                "put the base model dir back where it was, or give the job's config (--config) a model.init_from "
                "where it is now.",
            )
        here = self.base(weights)
        if saved is not None and saved != here:
            raise ConfigError(
                "model.init_from" if weights.init_from else "seed",
                f"gives a base ({here}) other than the one the checkpoint's adapters were trained on ({saved}).",
                "use the model dir (or seed) and model.lora.quantize_base the run started from, unchanged: the "
                "checkpoint holds the adapters alone.",
            )


def _differs(value: object, default: object) -> bool:
    """Whether a configured value is not its field's default (a list from the config against a tuple default)."""
    return tuple(value) != tuple(default) if isinstance(default, tuple) else value != default  # type: ignore[arg-type]
