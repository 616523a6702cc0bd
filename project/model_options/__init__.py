"""Model options: what a run does to a plain model beyond training it as it is, one file each, each a ``ModelOption``
(``project.job.model_option``) built from its typed config under ``model``: LoRA fine-tuning (``model.lora``), Float8
training (``model.float8``), a mixture's balancing (``model.expert_balancing``)."""

from collections.abc import Iterable

from project.job.model_option import ModelOption
from project.model_options.expert_balancing import ExpertBalancing
from project.model_options.float8_training import Float8Training
from project.model_options.lora_fine_tuning import LoRAFineTuning

# The order the options act in, at each hook: LoRA's adapters first (they decide which parameters train, and Float8
# does not convert their layers), then Float8's layers (before activation checkpointing, compile and the layout,
# torchtitan's order), then a mixture's balancing. An option of a class not listed comes after them.
ORDER: tuple[type[ModelOption], ...] = (LoRAFineTuning, Float8Training, ExpertBalancing)
# Each option's key under ``model`` in conf/model/language_model.yaml.
CONFIG_KEYS: dict[str, type[ModelOption]] = {
    "lora": LoRAFineTuning,
    "float8": Float8Training,
    "expert_balancing": ExpertBalancing,
}


def in_order(options: Iterable[ModelOption | None]) -> list[ModelOption]:
    """The options that are on (null in the config: off), in ``ORDER``."""
    enabled = [option for option in options if option is not None and option.enabled]
    rank = {cls: index for index, cls in enumerate(ORDER)}
    return sorted(enabled, key=lambda option: rank.get(type(option), len(ORDER)))


__all__ = ["CONFIG_KEYS", "ORDER", "ExpertBalancing", "Float8Training", "LoRAFineTuning", "in_order"]
