"""The epoch metrics: means over every sample (or token) of the epoch, summed on each rank, reduced once at its end.
(A mixture's routing, ``experts/*``, is its balancing option's: ``project.model_options.expert_balancing``.)"""

import torch
from torchmetrics import Metric


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

    def add(self, total: torch.Tensor, weight: torch.Tensor | int) -> None:
        """Add ``weight`` samples whose values sum to ``total`` (a tensor on the device: no sync)."""
        self.total += total
        self.weight += weight

    def compute(self) -> torch.Tensor:
        return (self.total / self.weight).float()
