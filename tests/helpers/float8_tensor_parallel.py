"""Run by tests/test_float8.py on 2 gloo ranks (``torch.distributed.run``): one forward and backward pass of a tiny
model in Float8, split over the 2 ranks by tensor parallelism, of the same model whole on one rank (torchao's
single-device Float8, the reference), and of the model unconverted. Writes, as JSON to the path given, for each case
the largest output difference and each parameter's gradient difference (norms), relative to the reference's, of
the split model and of the unconverted one, and how many layers torchao's float8 styles laid out.

Two layouts. ``sequence parallel``: as a run on this CPU lays the model out (emulated float8, so torch's styles).
``float8 styles``: as a GPU run does (torchao's float8 styles for the tensorwise layers, ``plan_as_on_gpus``), without
sequence parallelism: with it those styles all-gather float8 tensors, which gloo cannot carry."""

import copy
import dataclasses
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torchao.float8 import float8_tensor_parallel
from torchao.float8.float8_linear import Float8Linear

from project.models import MLP, Llama
from project.models.float8 import convert_to_float8, uses_float8_tensor_parallel_styles
from project.parallel import tensor_parallel_plans
from project.parallel.tensor_parallel_plans import apply_tensor_parallel

STYLES_APPLIED: list[str] = []  # each layer torchao's float8 styles laid out


def _counted(style: type) -> None:
    own = style._apply

    def apply(self, module: nn.Module, mesh) -> nn.Module:
        STYLES_APPLIED.append(type(self).__name__)
        return own(self, module, mesh)

    style._apply = apply


for _style in (float8_tensor_parallel.Float8ColwiseParallel, float8_tensor_parallel.Float8RowwiseParallel):
    _counted(_style)


def plan_as_on_gpus(module: nn.Module) -> bool:
    """The plan's rule for a layer as on a GPU, where the same layer does not emulate its matmuls."""
    if isinstance(module, Float8Linear):
        module = copy.copy(module)  # the rule reads its config alone
        module.config = dataclasses.replace(module.config, emulate=False)
    return uses_float8_tensor_parallel_styles(module)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def step(net: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The output and each parameter's gradient of a mean-square loss on it, whole."""
    out = whole(net(inputs))
    out.float().square().mean().backward()
    return out.detach(), {name: whole(parameter.grad) for name, parameter in net.named_parameters()}


def differences(got: tuple, want: tuple) -> dict:
    (out, grads), (out_want, grads_want) = got, want
    return {
        "output": ((out - out_want).abs().max() / out_want.abs().max()).item(),
        "gradients": {name: ((grads[name] - g).norm() / g.norm()).item() for name, g in grads_want.items()},
    }


def case(family: str, recipe: str, seed: int, layout: str) -> dict:
    torch.manual_seed(seed)
    if family == "llama":
        net: nn.Module = Llama(vocab_size=64, max_length=16, num_layers=2, dim=32, num_heads=4, num_kv_heads=2,
                               hidden_dim=64)  # fmt: skip
        inputs = torch.randint(0, 64, (4, 16))
    else:  # its classifier (16 classes) converted too, whole on every rank
        net = MLP(input_dim=32, hidden_dims=[64, 32], num_classes=16)
        inputs = torch.randn(16, 32)
    plain = copy.deepcopy(net)
    convert_to_float8(net, recipe, emulate=True, gather_in_float8=False, small_layers=True)
    reference = copy.deepcopy(net)
    STYLES_APPLIED.clear()
    own_rule = tensor_parallel_plans.uses_float8_tensor_parallel_styles
    if layout == "float8 styles":
        tensor_parallel_plans.uses_float8_tensor_parallel_styles = plan_as_on_gpus
    try:
        mesh = init_device_mesh("cpu", (2,))
        apply_tensor_parallel(net, mesh, sequence_parallel=layout == "sequence parallel", loss_parallel=False)
    finally:
        tensor_parallel_plans.uses_float8_tensor_parallel_styles = own_rule
    want = step(reference, inputs)
    return {
        "split": differences(step(net, inputs), want),
        "plain": differences(step(plain, inputs), want),
        "float8_layers": sum(isinstance(module, Float8Linear) for module in net.modules()),
        "float8_styles": len(STYLES_APPLIED),
    }


def main() -> None:
    dist.init_process_group("gloo")
    results = {
        f"{family} {recipe} {layout} {seed}": case(family, recipe, seed, layout)
        for family in ("llama", "mlp")
        for recipe in ("tensorwise", "rowwise")
        for layout in ("sequence parallel", "float8 styles")
        for seed in map(int, sys.argv[2].split(","))
    }
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as file:
            json.dump(results, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
