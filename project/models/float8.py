"""Float8 training (``model.float8``, ``project.model_options.float8_training``): the blocks' Linear layers run their
three matmuls (forward, the input's gradient, the weight's gradient) in 8-bit floats, torchao's ``Float8Linear``, as
torchtitan trains Llama 3.

Each matmul casts its operands to float8 with a scale computed from their current absolute maximum (dynamic
scaling): the input and the weight to e4m3, the output's gradient to e5m2 (``tensorwise``: one scale a tensor, the
fastest), or all three to e4m3 with one power-of-two scale per row (``rowwise``: more accurate, slower). The
weights themselves, their gradients and the optimizer state keep their dtype: checkpoints and exports are those of
an ordinary run.

Which layers (``float8_layers``): every ``nn.Linear`` inside the blocks whose two widths are multiples of 16 (what
the float8 matmul kernels take) and which is large enough to gain: torchao's own rule from its H100 measurements
(``_auto_filter_for_recipe``: under tensorwise scaling, not where the input is at most 4096 wide and the output at
most 1024; under rowwise, not where the output is at most 2048, the input at most 1024, or both at most 4096 and
2048). ``model.float8.small_layers`` converts the small ones too (tiny models, CPUs: where the rounding, not the
speed, is the point). Left in their own dtype: the stem and the head (the embedding and the output layer, which
decide the first and last activations: torchtitan's rule), a mixture's routers (a few experts wide, and what picks
them should not round) and its experts (grouped weights, not Linear layers).

On CUDA GPUs of compute capability 8.9 or more (Ada, Hopper, Blackwell) the matmuls run on float8 tensor cores
(``torch._scaled_mm``). Elsewhere (CPUs) torchao emulates them: the same casts and scales, the product of the
dequantized operands in the input's dtype, so a CPU run trains with a GPU run's rounding.

torchao is an optional dependency (``pip install 'project[float8]'``); nothing here imports it until a run asks.
"""

import dataclasses
import importlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Literal

from torch import nn
from torch.distributed.tensor import DTensor

from project.models.moe import Experts
from project.models.sequence import BlockSequence
from project.models.torchao_import import import_torchao

Float8Recipe = Literal["tensorwise", "rowwise"]
MULTIPLE = 16  # the float8 matmul kernels' rule for both widths of a weight
# The torchao releases whose float8-gathered weight ``fake_scales_flattened`` mends (their __tensor_flatten__ is the
# same).
TORCHAO_RELEASES = ("0.18.",)


def torchao_float8(submodule: str = "") -> ModuleType:
    """``torchao.float8`` or its ``submodule`` (``import_torchao``)."""
    return import_torchao(
        f"torchao.float8{submodule}",
        "model.float8.enabled",
        "pip install 'project[float8]' (torchao, the optional extra), or set model.float8.enabled=false.",
    )


@contextmanager
def fake_scales_flattened() -> Iterator[None]:
    """Within it (the memory plan's simulated step, on fake tensors), a float8-gathered weight flattens with its
    precomputed scale whenever it has one. torchao 0.18's flattens the scale only if the scale is true as a boolean:
    a real one always is (a positive number), but a fake one cannot be read, and the plan's trackers flatten every
    parameter. Whether a scale is there is what the test means. Mended on the releases it was read in
    (``TORCHAO_RELEASES``) alone, where torchao's float8 is imported (no such weight exists otherwise), and only
    within: a real run's weights keep torchao's own."""
    utils = sys.modules.get("torchao.float8.fsdp_utils")
    if utils is None or not importlib.import_module("torchao").__version__.startswith(TORCHAO_RELEASES):
        yield
        return
    wrapper = utils.WeightWithDynamicFloat8CastTensor
    own = wrapper.__tensor_flatten__
    wrapper.__tensor_flatten__ = _flatten_with_scale_if_any
    try:
        yield
    finally:
        wrapper.__tensor_flatten__ = own


def _flatten_with_scale_if_any(self: Any) -> tuple[list[str], dict[str, Any]]:
    tensors = ["_tensor"] if self._precomputed_scale is None else ["_tensor", "_precomputed_scale"]
    return tensors, {"mm_config": self._linear_mm_config, "dtype": self._dtype}


def float8_layers(net: BlockSequence, recipe: Float8Recipe, small_layers: bool = False) -> dict[str, nn.Linear]:
    """The layers Float8 training converts, by name under ``net``: the blocks' Linear layers whose widths are
    multiples of 16, but for a mixture's routers and, unless ``small_layers``, those torchao measured faster in bf16
    on H100s under ``recipe`` (its ``_auto_filter_for_recipe``; module docstring)."""
    routers = {id(module.router) for module in net.blocks.modules() if isinstance(module, Experts)}
    fast_enough = torchao_float8()._auto_filter_for_recipe(recipe, filter_fqns=[])
    return {
        f"blocks.{index}.{name}": module
        for index, block in enumerate(net.blocks)
        for name, module in block.named_modules()
        if isinstance(module, nn.Linear)
        and id(module) not in routers
        and module.in_features % MULTIPLE == 0
        and module.out_features % MULTIPLE == 0
        and (small_layers or fast_enough(module, name))
    }


def convert_to_float8(
    net: BlockSequence, recipe: Float8Recipe, emulate: bool, gather_in_float8: bool, small_layers: bool = False
) -> list[str]:
    """Swap ``float8_layers(net, recipe, small_layers)`` for torchao's ``Float8Linear`` (in place; on the meta
    device too, keeping each weight's name), and return their names. ``emulate``: compute the float8 matmuls in the
    input's dtype (CPUs). ``gather_in_float8``: FSDP2 all-gathers their weights cast to float8, a byte a weight
    (tensorwise only: torchao's weight wrapper; call ``precompute_float8_scales`` after each optimizer step)."""
    float8 = torchao_float8()
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulate,
        enable_fsdp_float8_all_gather=gather_in_float8 and recipe == "tensorwise",
    )
    chosen = float8_layers(net, recipe, small_layers)
    ids = {id(module) for module in chosen.values()}
    float8.convert_to_float8_training(net.blocks, config=config, module_filter_fn=lambda module, _: id(module) in ids)
    return list(chosen)


def uses_float8_tensor_parallel_styles(module: nn.Module) -> bool:
    """Whether tensor parallelism lays ``module`` out with torchao's float8 styles
    (``torchao.float8.float8_tensor_parallel``): a Float8 layer whose input is cast to float8 before sequence
    parallelism's all-gather (a byte an element) and its output's gradient before the backward's. Tensorwise scaling
    only, as torchao and torchtitan do: one scale a tensor, whose maximum over the ranks' shares is the whole
    tensor's. A rowwise layer keeps torch's styles and casts what they gather (torchtitan's rule too), as does an
    emulated one, and one with a bias: torchao's styles cast the output's gradient before the bias's own gradient is
    summed from it, which the layer whole sums in full precision (Llama's layers, torchtitan's, have none)."""
    linear = sys.modules.get("torchao.float8.float8_linear")  # not imported: nothing is a Float8 layer
    if linear is None or not isinstance(module, linear.Float8Linear):
        return False
    if module.config.emulate or module.bias is not None:  # emulated: on a CPU, whose gloo carries no float8
        return False
    tensorwise = torchao_float8().ScalingGranularity.TENSORWISE
    casts = (module.config.cast_config_input, module.config.cast_config_grad_output)
    return all(cast.scaling_granularity is tensorwise for cast in casts)


def precompute_float8_scales(net: nn.Module) -> None:
    """The float8 scales of every FSDP-sharded Float8 weight from its updated shards, in one all-reduce of their
    maxima (torchao's ``precompute_float8_dynamic_scale_for_fsdp``): without it each weight's all-gather would
    reduce its own maximum first, one small collective per layer and step."""
    torchao_float8().precompute_float8_dynamic_scale_for_fsdp(net)


def plain_weights(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a model's state dict) with the weights FSDP gathers in float8 as the plain tensors they are: torchao
    wraps each in a tensor subclass (of its DTensor shard) that a checkpoint would otherwise pickle, which only a
    reader trusting torchao's class could load."""
    wrapper = importlib.import_module("torchao.float8.fsdp_utils").WeightWithDynamicFloat8CastTensor

    def plain(value: Any) -> Any:
        if isinstance(value, DTensor) and isinstance(value._local_tensor, wrapper):
            local = value._local_tensor._tensor
            return DTensor.from_local(
                local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
            )
        return value._tensor if isinstance(value, wrapper) else value

    return {name: plain(value) for name, value in state.items()}
