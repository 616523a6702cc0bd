"""Initial weights that depend only on the seed: the same model whatever the strategy, device count or placement.

Every parameter draws from a generator of its own, seeded from the run's seed and the parameter's name, and each
model says how one parameter starts (``init_parameter``). So a rank that keeps a shard or a stage computes exactly
the values a single device would hold there, without ever building the whole model
(``project.parallel.parallelize.materialize``).
"""

import hashlib

import torch

from project.models.lora import init_adapter
from project.models.sequence import BlockSequence


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator for parameter ``name``: values are the same on every device type and process."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little"))


def initial_value(model: BlockSequence, name: str, seed: int) -> torch.Tensor:
    """The full-size initial value of ``model``'s parameter ``name``, in float32 on the CPU.

    ``model.init_parameter(name, tensor, generator)`` fills it (a LoRA adapter's: ``init_adapter``); the model's own
    parameter may be on the meta device, or a shard (its ``shape`` is the full one either way).
    """
    value = torch.empty(model.get_parameter(name).shape, dtype=torch.float32, device="cpu")
    generator = parameter_generator(seed, name)
    if not init_adapter(name, value, generator):
        model.init_parameter(name, value, generator)
    return value


@torch.no_grad()
def init_weights(model: BlockSequence, seed: int) -> BlockSequence:
    """Give every parameter of a plain (unsharded, materialised) model its initial value; returns the model."""
    for name, parameter in model.named_parameters():
        parameter.copy_(initial_value(model, name, seed))
    return model
