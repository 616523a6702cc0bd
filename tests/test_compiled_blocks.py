"""A compiled block in the plan (project/plan/compiled_blocks.py) against inductor itself: what ``torch.compile``
keeps for backward when it compiles the block on this CPU, and what its kernels read and write; and the plans of
compiled jobs."""

import logging
from collections.abc import Callable

import pytest
import torch
from test_memory_plan import resolved
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from project.models import GPT, Llama
from project.parallel.fake_process_group import fake_process_group
from project.parallel.parallelize import apply_activation_checkpointing
from project.parallel.tensor_parallel_plans import apply_tensor_parallel
from project.plan import compiled_blocks
from project.plan.compiled_blocks import partitioned_blocks
from project.plan.memory_plan import simulate_devices

pytestmark = pytest.mark.torch_internals

BATCH, SEQ = 2, 32


def first_block(family: str, checkpointing: str = "off") -> torch.nn.Module:
    """A one-block model's block, checkpointed as ``model.activation_checkpointing`` would."""
    torch.manual_seed(0)
    if family == "gpt":
        model = GPT(vocab_size=61, max_length=SEQ, num_layers=1, dim=64, num_heads=4)
    else:
        model = Llama(61, SEQ, 1, 64, 4, 2, 160, head_dim=16, qk_norm=True)  # Qwen 3's block
    apply_activation_checkpointing(model, checkpointing)
    return model.blocks[0]


# Each block shape, and a selectively checkpointed one (torchtitan's compiled recipe): the policy applied in the graph
FAMILIES = [("qwen3", "off"), ("gpt", "off"), ("qwen3", "selective")]


def saved_for_backward(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The block's output on ``x`` under bf16 autocast (as bf16-mixed runs it), and the tensors its forward saves for
    backward, as (shape, dtype), each storage once (a DTensor's local one)."""
    saved = {}

    def pack(tensor):
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        saved[local.untyped_storage()._cdata] = (tuple(local.shape), local.dtype)
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        output = block(x)
    return output, sorted(saved.values(), key=str)


@pytest.mark.slow  # inductor compiles C++ for each block: about 20 s each on 2 cores
@pytest.mark.parametrize(("family", "checkpointing"), FAMILIES)
def test_a_compiled_block_saves_what_inductor_saves(family, checkpointing):
    """The same block compiled by ``torch.compile`` (inductor's code, on this CPU) and run as the plan runs it
    (AOTAutograd's graphs, cut by inductor's partitioner, op by op): the same tensors saved for backward, fewer
    than eager autograd saves (without checkpointing), and the same output. Selectively checkpointed, the policy
    applied inside the graph: what it keeps (a matmul's output of two, attention's), its weights and its input."""
    x = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    eager_output, eager = saved_for_backward(first_block(family), x)
    inductor_block = first_block(family, checkpointing)
    inductor_block.forward = torch.compile(inductor_block.forward)
    _, inductor = saved_for_backward(inductor_block, x)
    planned_block = first_block(family, checkpointing)
    with partitioned_blocks([planned_block]) as partitioned:
        planned_output, planned = saved_for_backward(planned_block, x)
    assert partitioned.eager_fallbacks == {}
    assert planned == inductor
    assert sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in planned) < sum(
        torch.Size(shape).numel() * dtype.itemsize for shape, dtype in eager
    )
    torch.testing.assert_close(planned_output, eager_output)


def local_values(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's values on this rank (differentiable), a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def bytes_of_compiled_kernels(block: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[int, int, int]:
    """What ``torch.compile``'s code for ``block`` on this CPU reads and writes beside its extern kernels (matmuls,
    attention), forward and backward, by inductor's own per-kernel count (its metrics, logged when asked: each a
    kernel's bytes // 4), and how many such kernels it made: ``forward`` runs the compiled block (under bf16
    autocast), then the sum of its output's local values is backpropagated."""
    from torch._inductor import metrics
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    # Compiled anew (a cached graph's code is loaded without being counted), its metrics logged.
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        torch._logging.set_logs(inductor_metrics=True)
        try:
            torch._dynamo.reset()  # not a graph another test compiled
            metrics.reset()
            block.forward = torch.compile(block.forward)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                output = forward()
            forward_nodes = list(metrics.nodes_num_elem)
            local_values(output).sum().backward()
            backward_nodes = metrics.nodes_num_elem[len(forward_nodes) :]
        finally:
            torch._logging.set_logs()
    fused = [
        [count for node, count in nodes if not isinstance(node, ExternKernelSchedulerNode | NopKernelSchedulerNode)]
        for nodes in (forward_nodes, backward_nodes)
    ]
    return 4 * sum(fused[0]), 4 * sum(fused[1]), len(fused[0]) + len(fused[1])


@pytest.mark.slow  # inductor compiles C++ for each block: about 20 s each on 2 cores
@pytest.mark.parametrize(("family", "checkpointing"), FAMILIES)
def test_the_plans_kernel_bytes_are_inductors_own_count_of_a_real_compile(family, checkpointing):
    """The bytes the plan prices for a compiled block's fused kernels (inductor's scheduler run on its graphs,
    without code: ``FusedKernels``) are those inductor counts for the kernels it generates when ``torch.compile``
    compiles the same block on this CPU, forward and backward (a selective checkpoint's recompute in it), to its
    count's rounding (4 bytes a kernel)."""
    x = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    block = first_block(family, checkpointing)
    compiled = bytes_of_compiled_kernels(block, lambda: block(x))
    planned_block = first_block(family, checkpointing)
    with partitioned_blocks([planned_block]) as partitioned, torch.autocast("cpu", dtype=torch.bfloat16):
        assert_scheduled_as_compiled(partitioned.scheduled(planned_block, (x,), {}), compiled)


def assert_scheduled_as_compiled(
    scheduled: tuple[compiled_blocks.FusedKernels, compiled_blocks.FusedKernels] | None, compiled: tuple[int, int, int]
) -> None:
    """The plan's schedule of a block's graphs has the kernels of ``bytes_of_compiled_kernels``'s compile, and
    their bytes to its count's rounding."""
    compiled_forward, compiled_backward, kernels = compiled
    assert scheduled is not None
    forward, backward = scheduled
    assert forward.kernels + backward.kernels == kernels
    assert forward.moved_bytes == pytest.approx(compiled_forward, abs=4 * forward.kernels)
    assert backward.moved_bytes == pytest.approx(compiled_backward, abs=4 * backward.kernels)


def test_the_plan_prices_each_compiled_block_call_by_its_scheduled_bytes(monkeypatch):
    """A compiled Llama's plan adds, for each block's forward and each backward, the bytes inductor's scheduler
    gave that block's graphs, and nothing by rule for the ops inside: of two blocks, the step's bytes move by twice
    each graph's count when that count is set to 0, and by 2 GB a block when it is a gigabyte more; where the
    scheduler fails, the rule counts the ops inside (more than nothing)."""
    scheduled = compiled_blocks._scheduled

    def with_bytes(change):
        def schedule(graph_module, inputs, backward):
            kernels = scheduled(graph_module, inputs, backward)
            return compiled_blocks.FusedKernels(kernels.kernels, change(kernels.moved_bytes))

        return schedule

    def failing(graph_module, inputs, backward):
        raise RuntimeError("not scheduled")

    job = ["model=llama", "model.net.num_layers=2", "data=tokens", "data.seq_length=64", "data.batch_size=4"]
    job += ["cluster=h200_8x", "trainer.precision=bf16-mixed", "model.compile=true"]
    moved, graphs = {}, {}
    schedules = {"as scheduled": scheduled, "none": with_bytes(lambda _: 0), "more": with_bytes(lambda n: n + 10**9)}
    for name, schedule in {**schedules, "by rule": failing}.items():
        for cache in ("_TRACED", "_SCHEDULED"):
            monkeypatch.setattr(compiled_blocks, cache, {})
        monkeypatch.setattr(compiled_blocks, "_scheduled", schedule)
        devices, _ = simulate_devices(resolved(job))
        moved[name], graphs[name] = devices[0].moved_bytes, list(compiled_blocks._SCHEDULED.values())
    ((forward, backward),) = graphs["as scheduled"]  # both blocks alike: one signature
    assert moved["as scheduled"] - moved["none"] == 2 * (forward.moved_bytes + backward.moved_bytes)
    assert moved["more"] - moved["as scheduled"] == 2 * 2 * 10**9
    assert graphs["by rule"] == [] and moved["by rule"] > moved["none"]


class ComplexRotation(torch.nn.Module):
    """Pairs of ``x``'s last dimension turned by ``turns`` as complex numbers (torchtitan's RoPE, less its casts)."""

    def __init__(self, turns: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("turns", turns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.view_as_complex(x) * self.turns).flatten(-2)


def test_a_compiled_blocks_kernels_left_to_aten_are_priced_by_their_bytes():
    """Inductor generates no code for complex numbers: a block's complex multiply runs as ATen's kernel, forward
    and backward (a fallback). The plan prices those bytes too: the forward, made of nothing else (its views none),
    reads the input and the turns and writes the product, each a complex64 of 8 bytes; the backward's multiply reads
    the output's gradient and writes the input's, at least."""
    pairs, turns = 4 * 64 * 8, torch.polar(torch.ones(64, 8), torch.randn(64, 8))
    block = ComplexRotation(turns)
    with partitioned_blocks([block]) as partitioned:
        scheduled = partitioned.scheduled(block, (torch.randn(4, 64, 8, 2, requires_grad=True),), {})
    assert scheduled is not None
    forward, backward = scheduled
    assert forward.moved_bytes == 8 * (pairs + turns.numel() + pairs)
    assert backward.moved_bytes >= 8 * 2 * pairs


def test_blocks_that_differ_only_in_a_modules_class_are_traced_apart():
    """Two blocks of one class whose settings and shapes agree but one of whose modules differs in class (tanh
    against sigmoid) each run their own graphs, not the first one's."""
    x = torch.randn(4, 8)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(8, 8), activation()) for activation in (torch.nn.Tanh, torch.nn.Sigmoid)
    ]
    eager = [block(x) for block in blocks]
    with partitioned_blocks(blocks) as partitioned:
        planned = [block(x) for block in blocks]
    assert partitioned.eager_fallbacks == {}
    for output, expected in zip(planned, eager, strict=True):
        torch.testing.assert_close(output, expected)


def activations(overrides: list[str]) -> list[int]:
    job = resolved(["data=tokens", "data.seq_length=64", "data.batch_size=4", "cluster=h200_8x", *overrides])
    devices, _ = simulate_devices(job)
    return [device.activations for device in devices]


@pytest.mark.parametrize(
    "strategy",
    [["strategy=auto"], ["strategy=fsdp", "trainer.devices=2"], ["strategy=tensor_parallel", "trainer.devices=2"]],
)
def test_a_compiled_jobs_plan_keeps_the_partitions_activations(strategy, caplog):
    """A compiled Llama's plan runs its blocks as inductor partitions them, on one device, under FSDP (whose memory
    tracker's module hooks the trace must not meet) and under tensor parallelism (DTensor weights and inputs):
    fewer activations than the eager plan's, no block planned as eager."""
    model = ["model=llama", "trainer.precision=bf16-mixed", *strategy]
    with caplog.at_level(logging.WARNING, "project.plan.compiled_blocks"):
        compiled = activations([*model, "model.compile=true"])
    assert "planned as eager" not in caplog.text
    eager = activations([*model, "model.compile=false"])
    assert all(c < e for c, e in zip(compiled, eager, strict=True)), (compiled, eager)


def test_a_selectively_checkpointed_compiled_plan_recomputes_what_the_policy_leaves():
    """Selective checkpointing compiled (torchtitan's recipe): the policy applied inside the graph recomputes in
    the backward, and counts as recomputed (left out of MFU), the FLOPs of the matmuls it does not keep, every
    second one, as it does eager: a Llama block's key, output and up projections (2 FLOPs a weight and token). Its
    activations are fewer than the eager checkpoint's (the partitioner keeps none of the elementwise ops')."""
    overrides = ["model=llama", "trainer.precision=bf16-mixed", "model.activation_checkpointing=selective"]
    plans = {}
    for compiled in ("true", "false"):
        job = ["data=tokens", "data.seq_length=64", "data.batch_size=4", "cluster=h200_8x", *overrides]
        (plans[compiled],), _ = simulate_devices(resolved([*job, f"model.compile={compiled}"]))
    dim, kv_width, hidden, layers, tokens = 128, 64, 352, 2, 4 * 64  # conf/model/llama.yaml's, the batch's
    recomputed = 2 * tokens * layers * (dim * kv_width + dim * dim + dim * hidden)
    assert plans["true"].recomputed_flops == plans["false"].recomputed_flops == recomputed
    assert plans["true"].activations < plans["false"].activations


def tensor_parallel_net() -> torch.nn.Module:
    """A one-block GPT laid out over a tensor-parallel mesh of 2 (a rank of the fake process group the caller holds)
    as ``strategy.tensor_parallel_size=2`` lays it out: sequence parallel, the loss's logits split. (Not the Llama:
    the test compiles the block with ``torch.compile`` alone, and torch 2.13's compiled backward of the Llama's
    first block fails on its pending input, which ``compile_blocks`` waits for.)"""
    torch.manual_seed(0)
    net = GPT(vocab_size=61, max_length=SEQ, num_layers=1, dim=64, num_heads=4)
    apply_tensor_parallel(net, init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",)))
    return net


@pytest.mark.slow  # inductor compiles C++ for the block: about 20 s on 2 cores
def test_a_compiled_tensor_parallel_block_is_planned_as_inductor_compiles_it():
    """Under tensor parallelism a block's weights and input are DTensors, which the plan traces as AOTAutograd
    takes them apart. The net compiled by ``torch.compile`` on this CPU (rank 0 of 2 on the fake process group)
    and run as the plan runs it: the same tensors saved for backward, fewer than eager; inductor's kernels and its
    own count of their bytes, the collectives in its graphs left out (priced as communication)."""
    tokens = torch.randint(0, 61, (BATCH, SEQ))
    inductor: list = []

    def compiled_run(net: torch.nn.Module) -> torch.Tensor:
        output, saved = saved_for_backward(net, tokens)
        inductor.extend(saved)
        return output

    with fake_process_group(2, 0):
        _, eager = saved_for_backward(tensor_parallel_net(), tokens)
        net = tensor_parallel_net()
        compiled = bytes_of_compiled_kernels(net.blocks[0], lambda: compiled_run(net))
        planned_net = tensor_parallel_net()
        block_inputs = []
        planned_net.blocks[0].register_forward_pre_hook(lambda module, args: block_inputs.append(args))
        with partitioned_blocks(list(planned_net.blocks)) as partitioned:
            _, planned = saved_for_backward(planned_net, tokens)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                scheduled = partitioned.scheduled(planned_net.blocks[0], block_inputs[0], {})
    assert partitioned.eager_fallbacks == {}
    assert planned == inductor
    assert sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in planned) < sum(
        torch.Size(shape).numel() * dtype.itemsize for shape, dtype in eager
    )
    assert_scheduled_as_compiled(scheduled, compiled)


def test_a_tensor_parallel_block_is_traced_again_for_another_worlds_groups(monkeypatch):
    """One process plans several layouts (``plan=search``, the planner's other device counts): the same block over
    tensor-parallel pairs of a world of 2, then of a world of 4 (2 x 2), has the same shapes and placements but
    other process groups, which its graph's collectives name. Each world runs graphs traced in it (on torch 2.11,
    whose DTensor keeps its mesh out of its inner tensors, the second reused the first's and its collectives ran
    in the world of 4's default group: a shape error)."""
    monkeypatch.setattr(compiled_blocks, "_TRACED", {})
    monkeypatch.setattr(compiled_blocks, "_SCHEDULED", {})
    tokens = torch.randint(0, 61, (BATCH, SEQ))
    for world, dims, names in ((2, (2,), ("tensor_parallel",)), (4, (2, 2), ("data_parallel", "tensor_parallel"))):
        with fake_process_group(world, 0):
            torch.manual_seed(0)
            net = GPT(vocab_size=61, max_length=SEQ, num_layers=1, dim=64, num_heads=4)
            apply_tensor_parallel(net, init_device_mesh("cpu", dims, mesh_dim_names=names)["tensor_parallel"])
            with partitioned_blocks(list(net.blocks)) as partitioned:
                logits = local_values(net(tokens))
            assert partitioned.eager_fallbacks == {}
            assert logits.shape == (BATCH, SEQ, 61 // 2 + 1)  # this rank's share of the vocabulary
    assert len(compiled_blocks._TRACED) == 2


class KeywordBlock(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(x) * scale


def test_a_block_the_plan_cannot_trace_runs_eagerly_and_is_named(caplog, monkeypatch):
    """A block called with keyword arguments, which the tracing does not take: run as its own forward (its output
    as eager), and the plan says which block and why."""
    monkeypatch.setattr(compiled_blocks, "_SAID", set())  # said once a process: perhaps already, by another test
    block, x = KeywordBlock(), torch.randn(4, 8, requires_grad=True)
    with caplog.at_level(logging.WARNING, "project.plan.compiled_blocks"), partitioned_blocks([block]) as partitioned:
        output = block(x, scale=2.0)
    torch.testing.assert_close(output, torch.tanh(x) * 2.0)
    assert partitioned.eager_fallbacks == {"KeywordBlock": "called with keyword arguments ['scale']"}
    assert "KeywordBlock planned as eager: called with keyword arguments ['scale']" in caplog.text
