"""The plain models and the synthetic data."""

import torch

from project.data.synthetic import SyntheticDataModule, make_cluster_data
from project.models import MLP


def test_mlp_is_the_seed_large_model():
    with torch.device("meta"):  # 55M parameters, no memory allocated
        model = MLP(10000, [5000, 1000], 10)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(layer.in_features, layer.out_features) for layer in linears] == [(10000, 5000), (5000, 1000), (1000, 10)]
    assert sum(p.numel() for p in model.parameters()) == 10000 * 5000 + 5000 + 5000 * 1000 + 1000 + 1000 * 10 + 10
    assert len(model.blocks) == 3  # the ordered block sequence strategies act on
    assert sum(isinstance(m, torch.nn.ReLU) for m in model.modules()) == 2


def test_mlp_depth_and_widths_are_configurable():
    model = MLP(8, [16, 16, 16], 3)
    assert len(model.blocks) == 4
    assert model(torch.randn(5, 8)).shape == (5, 3)


def make_datamodule(seed: int) -> SyntheticDataModule:
    dm = SyntheticDataModule(
        num_features=32,
        num_classes=4,
        num_train=2000,
        num_val=500,
        latent_dim=8,
        clusters_per_class=2,
        cluster_std=0.5,
        noise_std=0.3,
        batch_size=32,
        seed=seed,
    )
    dm.setup("fit")
    return dm


def test_synthetic_data_is_deterministic_from_seed():
    a, b, c = make_datamodule(1), make_datamodule(1), make_datamodule(2)
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    assert torch.equal(a.val_set.tensors[1], b.val_set.tensors[1])
    assert not torch.equal(a.train_set.tensors[0], c.train_set.tensors[0])


def test_synthetic_labels_are_learnable_and_balanced():
    """A small MLP fitted on the training split must beat chance by far on the validation split."""
    torch.manual_seed(0)
    dm = make_datamodule(0)
    (x, y), (xv, yv) = dm.train_set.tensors, dm.val_set.tensors
    assert torch.bincount(y, minlength=4).min() > 0.15 * len(y)  # no class is rare
    model = MLP(32, [64], 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    accuracy = (model(xv).argmax(1) == yv).float().mean().item()
    assert accuracy > 0.8  # chance is 0.25


def test_generation_at_default_size():
    x, y = make_cluster_data(10240, 256, 10, 16, 8, 0.7, 0.5, torch.Generator().manual_seed(0))
    assert x.shape == (10240, 256) and y.shape == (10240,) and x.dtype == torch.float32
