"""LightningModules: they wrap the plain ``nn.Module`` models with loss, metrics and optimisation."""
