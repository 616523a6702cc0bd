"""Train models that outgrow one device: Lightning + Hydra, data parallel strategies, per-epoch metrics in W&B."""
