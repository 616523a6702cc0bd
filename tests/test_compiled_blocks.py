"""A compiled block in the memory plan (project/plan/compiled_blocks.py) against inductor itself: what
``torch.compile`` keeps for backward when it compiles the block on this CPU; and the plans of compiled jobs."""

import logging

import pytest
import torch
from test_memory_plan import resolved

from project.models import GPT, Llama
from project.plan import compiled_blocks
from project.plan.compiled_blocks import partitioned_blocks
from project.plan.memory_plan import simulate_devices

pytestmark = pytest.mark.torch_internals

BATCH, SEQ = 2, 32


def first_block(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        return GPT(vocab_size=61, max_length=SEQ, num_layers=1, dim=64, num_heads=4).blocks[0]
    return Llama(61, SEQ, 1, 64, 4, 2, 160, head_dim=16, qk_norm=True).blocks[0]  # Qwen 3's block


def saved_for_backward(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The block's output on ``x`` under bf16 autocast (as bf16-mixed runs it), and the tensors its forward saves for
    backward, as (shape, dtype), each storage once."""
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage()._cdata] = (tuple(tensor.shape), tensor.dtype)
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        output = block(x)
    return output, sorted(saved.values(), key=str)


@pytest.mark.slow  # inductor compiles C++ for each block: about 20 s each on 2 cores
@pytest.mark.parametrize("family", ["qwen3", "gpt"])
def test_a_compiled_block_saves_what_inductor_saves(family):
    """The same block compiled by ``torch.compile`` (inductor's code, on this CPU) and run as the plan runs it
    (AOTAutograd's graphs, cut by inductor's partitioner, op by op): the same tensors saved for backward, fewer
    than eager autograd saves, and the same output."""
    x = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    eager_output, eager = saved_for_backward(first_block(family), x)
    inductor_block = first_block(family)
    inductor_block.forward = torch.compile(inductor_block.forward)
    _, inductor = saved_for_backward(inductor_block, x)
    planned_block = first_block(family)
    with partitioned_blocks([planned_block]) as partitioned:
        planned_output, planned = saved_for_backward(planned_block, x)
    assert partitioned.eager_fallbacks == {}
    assert planned == inductor
    assert sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in planned) < sum(
        torch.Size(shape).numel() * dtype.itemsize for shape, dtype in eager
    )
    torch.testing.assert_close(planned_output, eager_output)


def activations(overrides: list[str]) -> list[int]:
    job = resolved(["data=tokens", "data.seq_length=64", "data.batch_size=4", "cluster=h200_8x", *overrides])
    devices, _ = simulate_devices(job)
    return [device.activations for device in devices]


@pytest.mark.parametrize("strategy", [["strategy=auto"], ["strategy=fsdp", "trainer.devices=2"]])
def test_a_compiled_jobs_plan_keeps_the_partitions_activations(strategy, caplog):
    """A compiled Llama's plan runs its blocks as inductor partitions them, on one device and under FSDP (whose
    memory tracker's module hooks the trace must not meet): fewer activations than the eager plan's, no block
    planned as eager."""
    model = ["model=llama", "trainer.precision=bf16-mixed", *strategy]
    with caplog.at_level(logging.WARNING, "project.plan.compiled_blocks"):
        compiled = activations([*model, "model.compile=true"])
    assert "planned as eager" not in caplog.text
    eager = activations([*model, "model.compile=false"])
    assert all(c < e for c, e in zip(compiled, eager, strict=True)), (compiled, eager)


def test_a_block_of_dtensors_is_planned_as_eager_and_named(caplog, monkeypatch):
    """Under tensor parallelism the blocks' weights are DTensors, which this tracing does not take: planned as
    eager, which the plan says."""
    monkeypatch.setattr(compiled_blocks, "_SAID", set())  # said once a process: perhaps already, by another test
    overrides = ["model=llama", "strategy=tensor_parallel", "trainer.devices=2"]
    with caplog.at_level(logging.WARNING, "project.plan.compiled_blocks"):
        compiled = activations([*overrides, "model.compile=true"])
    assert "Block planned as eager: a tensor subclass" in caplog.text
    assert compiled == activations([*overrides, "model.compile=false"])
