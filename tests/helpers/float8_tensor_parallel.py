"""Run by tests/test_float8.py on 2 gloo ranks (``torch.distributed.run``): one forward and backward pass of a tiny
model in Float8, split over the 2 ranks by tensor parallelism (sequence parallel), and of the same model whole on one
rank (torchao's single-device Float8, the reference), and of the model in its own precision. Writes, as JSON to the
path given, each case's largest output difference and each parameter's gradient difference (norms, relative to the
reference's), against the split model and against the plain one."""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from project.models import MLP, Llama
from project.models.float8 import convert_to_float8
from project.parallel.tensor_parallel_plans import apply_tensor_parallel


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


def case(family: str, recipe: str, seed: int) -> dict:
    torch.manual_seed(seed)
    if family == "llama":
        net: nn.Module = Llama(vocab_size=64, max_length=16, num_layers=2, dim=32, num_heads=4, num_kv_heads=2,
                               hidden_dim=64)  # fmt: skip
        inputs = torch.randint(0, 64, (4, 16))
    else:
        net = MLP(input_dim=32, hidden_dims=[64, 32], num_classes=4)
        inputs = torch.randn(16, 32)
    plain = copy.deepcopy(net)
    convert_to_float8(net, recipe, emulate=True, gather_in_float8=False, small_layers=True)
    reference = copy.deepcopy(net)
    apply_tensor_parallel(net, init_device_mesh("cpu", (2,)), sequence_parallel=True, loss_parallel=False)
    want = step(reference, inputs)
    return {
        "split": differences(step(net, inputs), want),
        "plain": differences(step(plain, inputs), want),
        "float8_layers": sum(type(module).__name__ == "Float8Linear" for module in net.modules()),
    }


def main() -> None:
    dist.init_process_group("gloo")
    results = {
        f"{family} {recipe} {seed}": case(family, recipe, seed)
        for family in ("llama", "mlp")
        for recipe in ("tensorwise", "rowwise")
        for seed in map(int, sys.argv[2].split(","))
    }
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as file:
            json.dump(results, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
