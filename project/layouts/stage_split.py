"""The rules of the layouts that split the model's block sequence into stages (model_parallel, pipeline)."""

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from project.job.job import Job
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.parallel.parallelize import block_sizes, split_blocks

if TYPE_CHECKING:  # the two layouts that split the blocks into stages, which use these rules
    from project.layouts.model_parallel_layout import ModelParallelLayout
    from project.layouts.pipeline_layout import PipelineLayout


def stage_split_problem(
    net: BlockSequence, num_stages: int, blocks_per_stage: Sequence[int] | None
) -> ConfigError | None:
    """What is wrong with splitting ``net`` (on the meta device) into ``num_stages`` stages (of
    ``blocks_per_stage`` blocks each, or balanced), or None: the split must exist, and stages cannot share weights."""
    stem_parameters = {id(parameter) for parameter in net.stem.parameters()}
    if any(id(parameter) in stem_parameters for parameter in net.head.parameters()):
        return ConfigError(
            "model.net.tie_weights",
            "ties the first stage's token embedding to the last stage's output layer, but stages on different "
            "devices would each train their own copy.",
            "set model.net.tie_weights=false for model_parallel and pipeline.",
        )
    try:
        split_blocks(block_sizes(net), num_stages, blocks_per_stage)
    except ValueError as error:
        key = "strategy.blocks_per_stage" if blocks_per_stage is not None else "strategy.num_stages"
        fix = (
            f"give {num_stages} positive counts that add up to {len(net.blocks)}, or blocks_per_stage=null to balance."
            if blocks_per_stage is not None
            else f"use at most {len(net.blocks)} stages (trainer.devices or strategy.num_stages), or a deeper model."
        )
        return ConfigError(key, f"cannot split the model: {error}.", fix)
    return None


def staged_at_depth(job: Job, layout: "ModelParallelLayout | PipelineLayout", blocks_per_stage: int) -> Job:
    """``job`` with each of ``layout``'s stages ``blocks_per_stage`` blocks deep (``Layout.at_depth``)."""
    stages = layout.num_stages
    model = replace(job.model, num_layers=blocks_per_stage * stages)
    return replace(job, model=model, layout=replace(layout, blocks_per_stage=(blocks_per_stage,) * stages))
