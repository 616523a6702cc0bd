"""A learnable synthetic classification set: Gaussian clusters in a low-dimensional latent space, seen through a
fixed random linear map.

Each class owns ``clusters_per_class`` cluster centres, so the classes are not linearly separable and an MLP has
something to learn; ``cluster_std`` sets how much the clusters overlap (harder as it grows). Labels follow from the
clusters, not random draws, so validation accuracy measures learning. Everything is drawn from ``seed``.
"""

from typing import Any

import torch
from torch.utils.data import TensorDataset

from project.data.datamodule import GeneratedDataModule
from project.options.option_types import NonNegativeFloat, PositiveInt, Seed


def make_cluster_data(
    num_samples: int,
    num_features: int,
    num_classes: int,
    latent_dim: int,
    clusters_per_class: int,
    cluster_std: float,
    noise_std: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs of width ``num_features`` and their labels; the first draws of ``generator`` fix the task."""
    centres = torch.randn(num_classes * clusters_per_class, latent_dim, generator=generator)
    projection = torch.randn(latent_dim, num_features, generator=generator) / latent_dim**0.5
    cluster = torch.randint(0, len(centres), (num_samples,), generator=generator)
    latent = centres[cluster] + cluster_std * torch.randn(num_samples, latent_dim, generator=generator)
    x = latent @ projection + noise_std * torch.randn(num_samples, num_features, generator=generator)
    return x, cluster % num_classes


class SyntheticDataModule(GeneratedDataModule):
    """Train and validation sets drawn from one task, deterministic from ``seed``."""

    def __init__(
        self,
        num_features: PositiveInt,
        num_classes: PositiveInt,
        num_train: PositiveInt,
        num_val: PositiveInt,
        latent_dim: PositiveInt,
        clusters_per_class: PositiveInt,
        cluster_std: NonNegativeFloat,
        noise_std: NonNegativeFloat,
        batch_size: PositiveInt,
        seed: Seed,
        shuffle: bool = True,
    ) -> None:
        super().__init__(num_train=num_train, num_val=num_val, batch_size=batch_size, seed=seed, shuffle=shuffle)
        self.num_features = num_features
        self.task: dict[str, Any] = dict(
            num_features=num_features,
            num_classes=num_classes,
            latent_dim=latent_dim,
            clusters_per_class=clusters_per_class,
            cluster_std=cluster_std,
            noise_std=noise_std,
        )

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        # One draw for both splits: same task, no sample in both.
        generator = torch.Generator().manual_seed(self.seed)
        x, y = make_cluster_data(self.num_train + self.num_val, generator=generator, **self.task)
        self.train_set = TensorDataset(x[: self.num_train], y[: self.num_train])
        self.val_set = TensorDataset(x[self.num_train :], y[self.num_train :])
