"""A task's precomputation at run time (``project.job.task.Precomputation``, DPO's reference): its values computed
once before the first step, each data-parallel replica its share under the job's layout, then held by every rank;
and whether a checkpoint's values can serve the run's data."""

import math
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from project.data.datamodule import DataModule, split_index_column, trainer_data
from project.data.sampling import data_parallel_rank_and_size
from project.job.task import Precomputation
from project.options.errors import ConfigError
from project.strategies.laid_out import LaidOutStrategy, RowFunction


def precomputed_values(
    trainer: L.Trainer, net: nn.Module, row_value: RowFunction, device: torch.device
) -> torch.Tensor:
    """(samples, rows of a sample): ``row_value`` of the net's outputs and the targets of every row of every sample
    (``DataModule.every_sample``), in float32 on ``device``, under ``net`` in evaluation mode, forward only: each
    data-parallel replica computes its share, and every rank ends with them all."""
    data = trainer_data(trainer)
    rank, replicas = data_parallel_rank_and_size(trainer)
    count = data.num_train_samples + data.num_val_samples
    # The ranks of the replica that computed a sample hold its values, alike; every other rank -inf, which the
    # maximum over all ranks drops. (Not a sum: the ranks of a replica, its pipeline stages or tensor-parallel ranks,
    # each hold them.)
    values = torch.full((count, data.sequences_per_sample), -math.inf, device=device)
    strategy, training = trainer.strategy, net.training
    net.eval()
    with torch.no_grad(), trainer.precision_plugin.forward_context():
        for samples, (inputs, target) in data.every_sample(rank, replicas):
            inputs, target = inputs.to(device), target.to(device)
            if data.index_column:  # the values are of the tokens' targets
                target = split_index_column(target)[0]
            if isinstance(strategy, LaidOutStrategy):  # its layout runs the net (a pipeline: stage by stage)
                rows = strategy.row_values(net, inputs, target, row_value)
            else:  # Lightning's own: the whole net on every rank
                rows = row_value(net(inputs), target)
            values[samples.to(device)] = rows.view(len(samples), -1).float()
    net.train(training)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def checkpoint_problem(
    precomputation: Precomputation, checkpoint: Mapping[str, Any], data: DataModule
) -> ConfigError | None:
    """Why ``checkpoint``'s values (those of the samples its fingerprint names) cannot serve ``data``'s samples, or
    None (they can, or it holds none)."""
    saved = checkpoint.get(precomputation.checkpoint_key)
    if saved is None or checkpoint.get(precomputation.fingerprint_key) == data.fingerprint():
        return None
    samples, what = f"{precomputation.sample}s", f"{precomputation.name} {precomputation.values}"
    return ConfigError(
        "data.path",
        f"holds other {samples} than the checkpoint's {what} were computed on ({len(saved)} {samples} then, "
        f"{data.num_train_samples + data.num_val_samples} now; the file, data.seq_length or data.tokenizer differ).",
        f"resume or evaluate with the data the run started with; for other {samples}, start a new run from the "
        "exported model.",
    )
