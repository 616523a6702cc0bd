"""Rules of the strategies that split the model's block sequence into stages (model_parallel, pipeline)."""

from omegaconf import DictConfig, OmegaConf

from project.config.errors import ConfigError
from project.distributed.parallelize import block_sizes, split_blocks
from project.models.sequence import BlockSequence


def check_stage_split(cfg: DictConfig, net: BlockSequence) -> None:
    """The configured split must exist for this model (``net`` on the meta device), and stages cannot share weights."""
    num_stages = cfg.strategy.num_stages
    if OmegaConf.select(cfg, "model.net.tie_weights"):
        raise ConfigError(
            "model.net.tie_weights",
            "ties the first stage's token embedding to the last stage's output layer, but stages on different "
            "devices would each train their own copy.",
            "set model.net.tie_weights=false for model_parallel and pipeline.",
        )
    blocks_per_stage = OmegaConf.select(cfg, "strategy.blocks_per_stage")
    try:
        split_blocks(block_sizes(net), num_stages, blocks_per_stage)
    except ValueError as error:
        key = "strategy.blocks_per_stage" if blocks_per_stage is not None else "strategy.num_stages"
        fix = (
            f"give {num_stages} positive counts that add up to {len(net.blocks)}, or blocks_per_stage=null to balance."
            if blocks_per_stage is not None
            else f"use at most {len(net.blocks)} stages (trainer.devices or strategy.num_stages), or a deeper model."
        )
        raise ConfigError(key, f"cannot split the model: {error}.", fix) from None
