"""``model.expert_balancing``: a mixture of experts' balancing as it trains (``project.models.moe``), by the net's own
settings: its weighted balance loss added to the training loss (``model.net.load_balancing_weight``), each expert's
score bias moved towards the mean load once every optimizer step, by that step's load (``model.net.bias_update_rate``:
DeepSeek-V3's balancing without a loss), and the routing over each epoch reported (the ``experts/*`` metrics,
``ExpertLoad``). Every language model has it (``conf/model/language_model.yaml``); it has no keys of its own, and does
nothing for a dense net.
"""

from dataclasses import dataclass, field

import torch
from torchmetrics import Metric

from project.job.job import Job
from project.job.model_option import ModelOption
from project.models.moe import MoE, RoutingTally, auxiliary_loss, mixtures
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError


class ExpertLoad(Metric):
    """A mixture of experts' routing over the training epoch, from its mixtures' tallies (``RoutingTally``), summed
    on each rank and reduced once at the epoch's end: for each of ``layers`` blocks (a dense block's row stays 0)
    and each of ``experts`` experts, the assignments it was given; per block, the assignments dropped, the sum of
    its forwards' balance losses and the forwards.

    ``compute`` gives ``experts/balance_loss`` (the mean over the mixtures of their mean balance loss: the number of
    experts a token goes to when perfectly balanced), ``experts/imbalance`` (the mean over the mixtures of the
    busiest expert's assignments over the mean expert's: 1 is even), ``experts/dropped_share`` (the share of the
    assignments a capacity dropped) and ``experts/load/<e>``, expert e's share of all the mixtures' assignments."""

    full_state_update = False
    load: torch.Tensor  # states, made by add_state
    dropped: torch.Tensor
    balance: torch.Tensor
    forwards: torch.Tensor

    def __init__(self, layers: int, experts: int) -> None:
        super().__init__()
        self.add_state("load", torch.zeros(layers, experts, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("dropped", torch.zeros(layers, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("balance", torch.zeros(layers, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("forwards", torch.zeros(layers, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, tallies: dict[int, RoutingTally]) -> None:
        """Add each block's tally (``tallies``: by block index, those with training forwards since the last)."""
        for layer, tally in tallies.items():
            self.load[layer] += tally.load
            self.dropped[layer] += tally.dropped
            self.balance[layer] += tally.balance
            self.forwards[layer] += tally.forwards

    def compute(self) -> dict[str, torch.Tensor]:
        mixtures = self.forwards > 0
        load = self.load[mixtures].double()
        total = load.sum()
        return {
            "experts/balance_loss": (self.balance[mixtures] / self.forwards[mixtures]).mean().float(),
            "experts/imbalance": (load.max(dim=1).values / load.mean(dim=1)).mean().float(),
            "experts/dropped_share": (self.dropped[mixtures].sum() / total).float(),
            **{f"experts/load/{expert}": (share / total).float() for expert, share in enumerate(load.sum(dim=0))},
        }


@dataclass
class ExpertBalancing(ModelOption):
    """Balances a mixture's experts as its net's settings say, and reports their routing each epoch; nothing for a
    net without mixtures."""

    load: ExpertLoad | None = field(default=None, init=False)  # the epoch's routing, once built on a mixture

    @property
    def enabled(self) -> bool:
        return True

    def problem(self, job: Job, net: BlockSequence) -> ConfigError | None:
        """The balance losses are each pipeline stage's own, and a pipeline's loss is the last stage's criterion."""
        weights = {mixture.load_balancing_weight for mixture in mixtures(net).values()} - {0.0}
        if weights and job.dims.pipelined:
            return ConfigError(
                "model.net.load_balancing_weight",
                "is not 0, but a pipeline's stages cannot add their mixtures' balance losses to the loss yet.",
                "set model.net.load_balancing_weight=0 under strategy=pipeline, or train with fsdp or ddp.",
            )
        return None

    def build(self, net: BlockSequence) -> None:
        if isinstance(net, MoE):
            self.load = ExpertLoad(net.num_layers, net.num_experts)

    def training_loss(self, net: BlockSequence) -> torch.Tensor | None:
        """The mixtures' weighted balance losses of the step's forward."""
        return auxiliary_loss(net)

    def epoch_metrics(self) -> dict[str, Metric]:
        return {} if self.load is None else {"expert_load": self.load}

    def before_optimizer_step(self, net: BlockSequence) -> None:
        """The mixtures' routing since the last step into the epoch's ``load`` (before the step, where a checkpoint
        of it would otherwise be saved first), and with a bias update rate, their score biases moved."""
        if self.load is None:
            return
        held = mixtures(net)
        tallies = {layer: tally for layer, mixture in held.items() if (tally := mixture.take_tally()) is not None}
        self.load.update(tallies)
        if any(mixture.bias_update_rate for mixture in held.values()):
            update_score_biases(held, tallies, self.load.load)


def update_score_biases(held: dict, tallies: dict, like: torch.Tensor) -> None:
    """Each held mixture's score bias moved after a step by its load: its assignments of this step on every rank
    (``tallies``: this rank's, by block index), summed over all ranks (a rank adds zeros for the blocks it does not
    hold, as a pipeline stage)."""
    load = torch.zeros_like(like)
    for layer, tally in tallies.items():
        load[layer] = tally.load
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(load)
    for layer, mixture in held.items():
        mixture.update_bias(load[layer])
