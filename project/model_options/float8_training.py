"""``model.float8``: Float8 training (``project.models.float8``, torchao's ``Float8Linear``): the blocks' Linear layers
run their matmuls in 8-bit floats, on float8 tensor cores (GPUs of compute capability 8.9 or more) or emulated
(CPUs). Converted before activation checkpointing, compile and the layout (torchtitan's order); where FSDP shards the
weights over data-parallel ranks under tensorwise scaling, it all-gathers them in float8, and one all-reduce after
each optimizer step gives the next gathers their scales. Off unless ``enabled``.
"""

from dataclasses import dataclass, field
from typing import Any

import torch

from project.job.job import Job
from project.job.model_option import InitialWeights, ModelOption, Target
from project.models.float8 import (
    Float8Recipe,
    convert_to_float8,
    plain_weights,
    precompute_float8_scales,
    torchao_float8,
)
from project.models.lora import LoRALinear
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError

FLOAT8_CAPABILITY = (8, 9)  # Ada, Hopper, Blackwell: the first CUDA GPUs with float8 tensor cores


@dataclass
class Float8Training(ModelOption):
    """The blocks' Linear layers in Float8 when ``enabled``, scaled by ``recipe``; ``small_layers``: also those
    torchao measured faster in bf16 (``project.models.float8.float8_layers``)."""

    enabled: bool = False
    recipe: Float8Recipe = "tensorwise"
    small_layers: bool = False
    layers: list[str] = field(default_factory=list, init=False)  # those converted, once prepared
    gathers_in_float8: bool = field(default=False, init=False)  # whether FSDP all-gathers their weights in float8

    def problem(self, job: Job, net: BlockSequence) -> ConfigError | None:
        """torchao installed; float8 tensor cores on the job's GPUs, or on the cluster it is planned for; no
        LoRA's layers, which it does not convert."""
        try:
            torchao_float8()
        except ConfigError as missing:
            return missing
        if job.uses_cuda:
            older = {
                torch.cuda.get_device_name(index)
                for index in range(job.devices)
                if torch.cuda.get_device_capability(index) < FLOAT8_CAPABILITY
            }
            if older:
                return ConfigError(
                    "model.float8.enabled",
                    f"is true, but {', '.join(sorted(older))} has no float8 tensor cores (compute capability below "
                    "8.9).",
                    "set model.float8.enabled=false on these GPUs (bf16-mixed is their fastest), or train on H100, "
                    "H200 or L40S.",
                )
        if job.cluster is not None and job.cluster.float8_peak_tflops is None:
            return ConfigError(
                "model.float8.enabled",
                f"is true, but cluster={job.cluster.name}'s GPUs have no float8 tensor cores "
                "(cluster.float8_peak_tflops).",
                "plan for GPUs that have them (cluster=h100_sxm_8x or h200_8x), or set model.float8.enabled=false.",
            )
        if any(isinstance(module, LoRALinear) for module in net.modules()):
            return ConfigError(
                "model.float8.enabled",
                "is true with LoRA adapters (model.lora), which Float8 training does not convert.",
                "set model.float8.enabled=false to fine-tune with LoRA, or model.lora.rank=0 to train in Float8.",
            )
        return None

    def prepare(self, net: BlockSequence, target: Target) -> None:
        """Its layers to Float8: on float8 tensor cores on CUDA, else emulated; gathered in float8 where FSDP shards
        them (tensorwise only)."""
        self.gathers_in_float8 = target.sharded and self.recipe == "tensorwise"
        self.layers = convert_to_float8(
            net,
            self.recipe,
            emulate=not target.cuda,
            gather_in_float8=self.gathers_in_float8,
            small_layers=self.small_layers,
        )

    def summary(self) -> str:
        gathered = "; FSDP gathers their weights in float8" if self.gathers_in_float8 else ""
        small = "" if self.small_layers else ", the small layers (model.float8.small_layers)"
        return (
            f"Float8 ({self.recipe}): {len(self.layers)} Linear layers of the blocks convert their matmuls{gathered}. "
            f"The embedding, output layer, routers{small} and layers of widths not in 16s keep the run's precision."
        )

    def after_weights_change(self, net: BlockSequence) -> None:
        """The scales of the next all-gathers, from the weights as they now are."""
        if self.gathers_in_float8:
            precompute_float8_scales(net)

    def on_save_checkpoint(self, checkpoint: dict[str, Any], weights: InitialWeights) -> None:
        """Weights gathered in float8 saved as the plain tensors they are (``plain_weights``)."""
        if self.gathers_in_float8:
            checkpoint["state_dict"] = plain_weights(checkpoint["state_dict"])
