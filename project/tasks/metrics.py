"""The epoch metrics: means over every sample (or token) of the epoch, and a mixture of experts' routing, summed on
each rank, reduced once at its end."""

import torch
from torchmetrics import Metric

from project.models.moe import RoutingTally


class SampleMean(Metric):
    """The mean of values over the epoch: added one by one (``update``), or as a batch's sum and count (``add``: a
    batch's summed loss and its trained targets).

    torchmetrics' ``MeanMetric`` checks every update for NaN (``.any()``: a device sync per step on a GPU) and drops
    NaNs, hiding a diverged run; its ``nan_strategy="disable"`` skips the check but then ignores the weights
    (torchmetrics 1.8). Here an update is two additions on the device, and a NaN shows in the epoch's value.
    """

    full_state_update = False
    total: torch.Tensor  # states, made by add_state
    weight: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("weight", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, values: torch.Tensor) -> None:
        """Add ``values``, each one sample."""
        self.total += values.sum()
        self.weight += values.numel()

    def add(self, total: torch.Tensor, weight: torch.Tensor) -> None:
        """Add ``weight`` samples whose values sum to ``total`` (tensors on the device: no sync)."""
        self.total += total
        self.weight += weight

    def compute(self) -> torch.Tensor:
        return (self.total / self.weight).float()


class SampleAccuracy(SampleMean):
    """The fraction of samples whose most likely class is the target."""

    # Its own update arguments (logits and targets), as torchmetrics' metrics each have.
    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:  # type: ignore[override]
        super().update(logits.argmax(-1) == target)


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
