"""The step-time model (project/plan/step_time.py) against the same arithmetic done here step by step: what a step
counts (an elementwise op's bytes, fused or not; a matmul's FLOPs, bytes and tiles; attention's exponentials),
each kernel's roofline, the clock at a power limit, ring collectives with NCCL's latency over the link their group
crosses, data-parallel traffic hidden behind compute up to its length, the pipeline's bubble; what the host runs
(its ops, eager or compiled, and its other costs) and how it sets the pace of a GPU's step, or adds to a CPU's."""

import dataclasses
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, TINY_GPT
from test_memory_plan import resolved

from project.accounting.counts import Kernel, Link, StepCounts
from project.job.cluster import Cluster
from project.parallel.dims import ParallelDims
from project.plan.memory_plan import MemoryPlan, plan_memory, simulate_devices
from project.plan.simulate import DevicePlan
from project.plan.step_time import (
    FRAMEWORK_STEP_OPS,
    HOST_COSTS,
    clock_ratio,
    collective_seconds,
    host_time,
    kernel_seconds,
    predict_step,
    wave_share,
    wire_bytes,
)

pytestmark = pytest.mark.torch_internals
sys.path.insert(0, str(REPO / "benchmarks"))  # benchmarks/step_time.py's Megatron count

# Round numbers: 100 TFLOPS at half efficiency is 5e13 FLOP/s; 1 TB/s at 80% is 8e11 B/s; 100 GB/s in a node, 10
# GB/s between nodes; 2e12 exponentials a second.
CLUSTER = Cluster(
    name="test",
    kind="gpu",
    peak_tflops=100,
    float8_peak_tflops=200,
    memory_gb=80,
    memory_tb_per_s=1,
    multiprocessors=10,
    exp_tera_per_s=2,
    rated_power_w=700,
    power_limit_w=700,
    devices_per_node=4,
    intra_node_gb_per_s=100,
    inter_node_gb_per_s=10,
    matmul_efficiency=0.5,
    float8_matmul_efficiency=0.4,
    attention_efficiency=0.25,
    bandwidth_efficiency=0.8,
    host_op_us=10.0,  # 1e5 eager ops a second
    collective_latency_us=None,
)
PIPELINE = ["model=gpt", "data=tokens", "strategy=pipeline", "trainer.devices=4", "trainer.num_nodes=2"]


def device(name: str, flops: int, collectives: dict[Link, int]) -> DevicePlan:
    """A device whose compute is one kernel of ``flops`` (no bytes, whole waves: at 5e13 FLOP/s here), and whose
    collectives run once each."""
    return DevicePlan(
        name,
        *[0] * 6,
        flops=flops,
        kernels={Kernel("compute", flops, 0).key: 1},
        collectives={k.key: v for k, v in collectives.items()},
        collective_calls={k.key: 1 for k in collectives},
    )


def latency(link: Link) -> float:
    """NCCL's ring latency of one collective (project/plan/step_time.py), by hand for the links below."""
    return collective_seconds(link, 0, 1, CLUSTER)


def test_an_elementwise_op_moves_its_inputs_and_output():
    x, y = torch.ones(1000), torch.ones(1000)
    with StepCounts(4, "data_parallel") as counts:
        z = x * y  # reads 2 x 4,000 B, writes 4,000 B
        z.add_(1)  # reads and writes z: 8,000 B
        z.view(10, 100)  # a view: nothing
        torch.empty(10**6)  # an allocation: nothing
    assert counts.moved_bytes == 12_000 + 8_000
    assert not counts.kernels and counts.flops == 0


def test_a_fused_chain_reads_only_what_no_elementwise_op_wrote_and_writes_what_is_needed():
    """Under compile, (x * 2 + 1).exp() is one kernel: it reads x once, and writes only what is needed in memory:
    what a matmul reads, what autograd keeps (``materialize``), what is alive when the step ends (``flush``)."""
    x, w = torch.ones(10, 100), torch.ones(100, 10)
    with StepCounts(4, "data_parallel", fused=True) as counts:
        y = ((x * 2) + 1).exp()  # reads x: 4,000 B; its two intermediates die in registers
        assert counts.moved_bytes == 4_000
        y @ w  # the matmul reads y from memory: the chain wrote it (4,000 B); the matmul's bytes are its kernel's
        assert counts.moved_bytes == 2 * 4_000
        kept = y.sin()  # reads nothing from memory (y is the chain's); written only once something needs it
        counts.materialize(kept)  # autograd keeps it for backward: 4,000 B
        counts.materialize(kept)  # once
        alive = kept.cos()  # alive at the step's end: 4,000 B
        counts.flush()
        del alive  # alive until the flush above
    assert counts.moved_bytes == 4 * 4_000
    with StepCounts(4, "data_parallel") as eager:
        ((x * 2) + 1).exp()
    assert eager.moved_bytes == 3 * (4_000 + 4_000)


@pytest.mark.parametrize("fused", ["false", "true"], ids=["plain", "fused"])
def test_model_compile_prices_the_loss_as_compiled_too(fused):
    """With model.compile the task compiles its loss (TokenCrossEntropy's ``compile_summed``, or the fused loss's
    chunks), and the simulation counts it as fused kernels: of a GPT whose 2,048-token vocabulary makes the loss most
    of its memory traffic, a step moves fewer bytes than with the blocks alone counted as compiled."""
    from project.plan.simulate import _fused_in_compiled

    job = resolved(
        [*TINY_GPT, "data.vocab_size=2048", "model.compile=true", f"model.fused_loss={fused}", "logger=none"]
    )
    module = job.new_module()
    module.net.to_empty(device="cpu")
    tokens = torch.randint(0, 2048, (8, 16))
    moved = {}
    for loss in (module.compiled_loss_module(), None):
        module.compiled_loss_module = lambda loss=loss: loss
        module.net.zero_grad(set_to_none=True)  # each backward writes its gradients afresh
        with StepCounts(1, "data_parallel") as counts, _fused_in_compiled(module.net, module, counts):
            module.loss(module.net_outputs(module.net, tokens, tokens), tokens).value.backward()
        moved[loss is not None] = counts.moved_bytes
    assert moved[True] < moved[False]


def test_a_matmul_counts_its_flops_bytes_and_output_tiles():
    a, b = torch.ones(300, 200), torch.ones(200, 500)
    with StepCounts(4, "data_parallel") as counts:
        a @ b
    kernel = Kernel("matmul", 2 * 300 * 200 * 500, 4 * (300 * 200 + 200 * 500 + 300 * 500), tiles=3 * 4, rows=300)
    assert counts.kernels == {kernel.key: 1}
    assert counts.flops == kernel.flops and counts.moved_bytes == 0


def test_a_grouped_matmul_counts_each_groups_products_forward_and_backward():
    """The experts' grouped matmul, 30 rows of width 24 into 4 experts of 16 (rows 12, 0, 11, 7): forward and
    the two gradients are each 2 x 30 x 24 x 16 FLOPs, however the rows are grouped; the weight's gradient is
    the grouped matmul of two 2-D operands, whose output (4 x 24 x 16) sums each group's own rows only."""
    rows = torch.ones(30, 24, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(4, 16, 24, dtype=torch.bfloat16, requires_grad=True)
    ends = torch.tensor([12, 12, 23, 30], dtype=torch.int32)
    with StepCounts(4, "data_parallel") as counts:
        out = torch._grouped_mm(rows, weight.mT, offs=ends)
        out.backward(torch.ones_like(out))
    assert counts.flops == 3 * 2 * 30 * 24 * 16
    assert {Kernel.parse(key).kind for key in counts.kernels} == {"matmul"}
    assert sum(counts.kernels.values()) == 3


def test_causal_attention_counts_its_scores_exponentials():
    q = k = v = torch.ones(2, 3, 64, 16)  # batch 2, 3 heads, 64 tokens, width 16
    with StepCounts(4, "data_parallel") as counts:
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (key,) = counts.kernels
    kernel = Kernel.parse(key)
    assert kernel.kind == "attention" and kernel.causal
    assert kernel.exponentials == 2 * 3 * 64 * 64
    assert kernel.flops == 4 * 2 * 3 * 64 * 64 * 16  # torch's formula: two products of all 64 x 64 scores


def test_each_kernel_is_the_longer_of_its_arithmetic_and_its_bytes():
    big = Kernel("matmul", 10**12, 10**8, tiles=20)  # two whole waves of 10: 1e12 / 5e13 = 0.02 s; bytes 1.25e-4 s
    assert kernel_seconds(big, CLUSTER) == pytest.approx(0.02)
    ragged = Kernel("matmul", 10**12, 10**8, tiles=12)  # 12 tiles: a wave of 10 and one of 2, 60% busy
    assert wave_share(12, 10) == pytest.approx(0.6)
    assert kernel_seconds(ragged, CLUSTER) == pytest.approx(0.02 / 0.6)
    skinny = Kernel("matmul", 10**9, 10**9, tiles=10)  # 2e-5 s of arithmetic, 1e9 / 8e11 = 1.25e-3 s of bytes
    assert kernel_seconds(skinny, CLUSTER) == pytest.approx(1.25e-3)
    # Float8: its own share (40%) of the FP8 peak (200 TFLOPS): 1e12 / 8e13 over its two whole waves.
    assert kernel_seconds(Kernel("float8_matmul", 10**12, 10**8, tiles=20), CLUSTER) == pytest.approx(0.0125)
    # Causal attention: half the counted products at 25% of the peak, half the exponentials at 2e12 a second.
    attention = Kernel("attention", 10**12, 10**6, exponentials=10**10, causal=True)
    assert kernel_seconds(attention, CLUSTER) == pytest.approx(0.5e12 / 2.5e13 + 0.5e10 / 2e12)


def test_a_cpus_matmul_of_few_rows_pays_for_packing_its_operand():
    """On a CPU a matmul costs as if it had CPU_PACKING_ROWS (16) more rows: 16 rows twice their arithmetic, 2048
    rows 1/128 more; a GPU's is its arithmetic over its waves alone, and a kernel without rows counted is priced as
    before."""
    cpu = dataclasses.replace(CLUSTER, kind="cpu")
    arithmetic = 10**12 / 5e13  # at half of 100 TFLOPS, in whole waves
    for rows, factor in [(16, 2.0), (2048, 1 + 16 / 2048)]:
        kernel = Kernel("matmul", 10**12, 0, tiles=10, rows=rows)
        assert kernel_seconds(kernel, cpu) == pytest.approx(factor * arithmetic)
        assert kernel_seconds(kernel, CLUSTER) == pytest.approx(arithmetic)
    assert kernel_seconds(Kernel("matmul", 10**12, 0, tiles=10), cpu) == pytest.approx(arithmetic)


def test_a_power_limit_slows_the_clock_by_its_cube_root():
    limited = dataclasses.replace(CLUSTER, power_limit_w=500)
    assert clock_ratio(CLUSTER) == 1.0
    assert clock_ratio(limited) == pytest.approx((500 / 700) ** (1 / 3))  # 0.894: 884 of 989 TFLOPS
    kernel = Kernel("matmul", 10**12, 0, tiles=10)
    assert kernel_seconds(kernel, limited) == pytest.approx(0.02 / (500 / 700) ** (1 / 3))


def test_a_collective_pays_nccl_ring_latency_per_call():
    """NCCL's tuning model, ring and Simple protocol: 8.4 us, then 3.4 us a step over NVLink and 9.6 us a step
    between nodes; an all-gather of n ranks takes n - 1 steps, an all-reduce twice that."""
    in_node = Link("all_gather", "data_parallel", 4, 1)
    assert latency(in_node) == pytest.approx((8.4 + 3 * 3.4) * 1e-6)
    across = Link("all_reduce", "data_parallel", 8, 2)  # 14 steps, 2 of them between the nodes
    assert latency(across) == pytest.approx((8.4 + 12 * 3.4 + 2 * 9.6) * 1e-6)
    size = 4 * 10**9  # 3/4 of it on the wire in a node, at 100 GB/s; ten calls pay ten latencies
    assert collective_seconds(in_node, size, 10, CLUSTER) == pytest.approx(10 * latency(in_node) + 0.03)
    assert math.isclose(collective_seconds(Link("send", "pipeline", 2, 2), 10**9, 1, CLUSTER), 0.1 + 18e-6)


def test_a_ring_across_nodes_crosses_them_over_each_ranks_port():
    """NCCL runs a collective as one ring a channel, each channel crossing between nodes at another GPU's port: an
    all-gather of 8 ranks, 4 on each of 2 nodes, puts 7/8 of its 4 GB on the wire at 4 x 10 GB/s (3.5 GB in
    0.0875 s); with 30 GB/s ports, 4 of them would pass 120 GB/s, above NVLink's 100, which then sets the pace
    (an all-reduce: 2 x 7/8 x 4 GB). A group of one rank a node, a send and an all-to-all cross at one port."""
    size = 4 * 10**9
    spread = Link("all_gather", "data_parallel", 8, 2)
    assert collective_seconds(spread, size, 1, CLUSTER) == pytest.approx(latency(spread) + 3.5e9 / 40e9)
    fast_ports = dataclasses.replace(CLUSTER, inter_node_gb_per_s=30)
    reduced = Link("all_reduce", "data_parallel", 8, 2)
    assert collective_seconds(reduced, size, 1, fast_ports) == pytest.approx(latency(reduced) + 7e9 / 100e9)
    for one_port in (Link("all_gather", "data_parallel", 2, 2), Link("all_to_all", "expert_parallel", 8, 2)):
        assert collective_seconds(one_port, size, 1, CLUSTER) == pytest.approx(
            latency(one_port) + wire_bytes(one_port, size) / 10e9
        )


# Two pipeline ranks of 8 (4 stages of 2 data-parallel ranks, 4 devices a node).
FIRST = device(
    "rank 0",
    10**14,  # 2 s of compute
    {
        Link("all_gather", "data_parallel", 2, 1): 4 * 10**9,  # half on the wire in a node: 0.02 s, hidden
        Link("send", "pipeline", 4, 2): 10**9,  # 1e9 B between nodes: 0.1 s, waited for
    },
)
SECOND_LINKS = {
    Link("all_reduce", "tensor_parallel", 2, 1): 5 * 10**9,  # 2 x 1/2 x 5e9 B in a node: 0.05 s, waited for
    Link("reduce_scatter", "data_parallel", 2, 2): 60 * 10**9,  # 30e9 B between nodes: 3 s, 0.6 s beyond compute
    Link("send", "pipeline", 4, 2): 10**9,  # 0.1 s
}
SECOND = device("rank 1", 12 * 10**13, SECOND_LINKS)  # 2.4 s


@pytest.mark.parametrize(
    "schedule, stages, microbatches, bubble_share",
    [
        ("1f1b", 4, 8, 3 / (8 + 3)),  # (S - 1) / (M + S - 1)
        ("interleaved_1f1b", 8, 8, 3 / (2 * 8 + 3)),  # v = 2 stages a rank: (S - 1) / (v M + S - 1)
    ],
)
def test_a_step_is_the_slowest_rank_stretched_by_the_bubble(schedule, stages, microbatches, bubble_share):
    per_rank = stages // 4
    job = resolved(
        [
            *PIPELINE,
            f"strategy.schedule={schedule}",
            f"strategy.num_stages={stages}",
            f"strategy.stages_per_rank={per_rank}",
            f"strategy.microbatches={microbatches}",
            f"data.batch_size={microbatches}",
        ]
    )
    assert job.dims == ParallelDims(8, pipeline=4, shard=True, pipelined=True)  # 2 replicas
    plan = MemoryPlan([FIRST, SECOND], 80 * 2**30, "test", False, 8)
    step = predict_step(plan, job, CLUSTER)
    # The second rank: compute, tensor parallel, sends, what compute cannot hide, and each collective's latency.
    busy = 2.4 + 0.05 + 0.1 + (3.0 - 2.4) + sum(map(latency, SECOND_LINKS))
    assert step.compute == pytest.approx(2.4)
    assert step.exposed_communication == pytest.approx(busy - 2.4)
    assert step.seconds == pytest.approx(busy / (1 - bubble_share))
    assert step.bubble == pytest.approx(step.seconds - busy)
    tokens = microbatches * job.seq_length * 2 / 8  # a replica's batch, 2 replicas, over 8 GPUs
    assert step.tokens_per_device_per_s == pytest.approx(tokens / step.seconds)
    assert step.mfu == pytest.approx(12 * 10**13 / step.seconds / 10**14)


def test_data_parallel_traffic_within_the_compute_costs_nothing():
    """FSDP alone: its gathers and reductions overlap the blocks' compute, so a step is its compute until the
    traffic outlasts it."""
    job = resolved(["model=gpt", "data=tokens", "strategy=fsdp", "trainer.devices=4"])
    assert job.dims == ParallelDims(4, shard=True)
    gather = Link("all_gather", "data_parallel", 4, 1)
    for wire_seconds, step_seconds in ((1.5, 2.0), (2.5, 2.5 + latency(gather))):
        size = int(wire_seconds * 100 * 10**9 * 4 / 3)  # an all-gather of 4 ranks puts 3/4 on the wire
        rank = device("rank 0", 10**14, {gather: size})
        step = predict_step(MemoryPlan([rank], 2**40, "test", False, 4), job, CLUSTER)
        assert step.seconds == pytest.approx(step_seconds, rel=1e-6)


def test_an_expert_parallel_all_to_all_over_data_parallel_ranks_adds_all_of_itself():
    """A mixture's rows go to their experts' ranks and back over the data-parallel ranks, but the experts wait for
    them: unlike FSDP's traffic, none of it hides behind the compute."""
    job = resolved(
        ["model=moe", "data=tokens", "strategy=fsdp", "trainer.devices=2", "strategy.expert_parallel_size=2"]
    )
    exchange = Link("all_to_all", "data_parallel", 2, 1)
    size = int(0.5 * 100 * 10**9 * 2)  # half a second on the wire: an all-to-all of 2 ranks sends half its buffer
    rank = device("rank 0", 10**14, {exchange: size})
    step = predict_step(MemoryPlan([rank], 2**40, "test", False, 2), job, CLUSTER)
    assert step.seconds == pytest.approx(2.0 + 0.5 + latency(exchange), rel=1e-6)  # 2 s of compute, as above


def test_the_host_counts_each_op_it_dispatches_and_each_kernel_a_compiled_region_launches():
    """Eager: every op, views included (each costs the dispatcher). Compiled (``fused``): a matmul is a kernel of
    its own, each chain of elementwise ops between matmuls one fused kernel, a view nothing."""
    a, w = torch.randn(4, 8), torch.randn(8, 8)
    counts = StepCounts(devices_per_node=1, world_dim="world")
    with counts:
        (a @ w + 1).relu().view(32)
    assert counts.host_ops == {"eager": 4}
    compiled = StepCounts(devices_per_node=1, world_dim="world")
    with compiled:
        compiled.fused = True
        compiled.compiled_call()
        x = (a @ w + 1).relu().view(32).view(4, 8)  # matmul; add and relu fused; two views
        (x @ w).tanh().mul(2)  # matmul; tanh and mul fused
    assert compiled.host_ops == {"compiled_calls": 1, "compiled_kernels": 4}


def test_the_plan_counts_fsdp_modules_dtensors_and_compiled_calls_as_the_layout_runs_them():
    """FSDP over 2 ranks: a module for each block and the root, optimizer steps over DTensors; over one rank it does
    not wrap (nothing to shard), the step of one device. Compiled: each block's forward and backward is a call."""
    blocks = 2  # TINY_GPT's
    sharded = plan_memory(resolved([*TINY_GPT, "strategy=fsdp", "trainer.devices=2"]), suggest=False).devices[0]
    assert sharded.host_ops["fsdp_modules"] == blocks + 1 and sharded.host_ops["dtensor"] > 0
    one_rank = plan_memory(resolved([*TINY_GPT, "strategy=fsdp", "trainer.devices=1"]), suggest=False).devices[0]
    plain = plan_memory(resolved(TINY_GPT), suggest=False).devices[0]
    assert one_rank.host_ops == plain.host_ops and one_rank.host_ops["fsdp_modules"] == 0
    assert one_rank.peak == plain.peak
    compiled = plan_memory(resolved([*TINY_GPT, "model.compile=true"]), suggest=False).devices[0]
    loss_calls = 2  # the loss of the logits, compiled with the blocks: its forward and backward
    assert compiled.host_ops["compiled_calls"] == 2 * blocks + loss_calls
    assert compiled.host_ops["eager"] < plain.host_ops["eager"] / 2


HOST_OPS = {"eager": 1000, "compiled_calls": 10, "compiled_kernels": 100, "dtensor": 50, "fsdp_modules": 3}


def test_the_host_prices_an_eager_op_at_the_clusters_speed_and_the_rest_in_eager_ops():
    rank = dataclasses.replace(device("rank 0", 0, {}), host_ops=HOST_OPS)
    other = sum(HOST_COSTS[name] * count for name, count in HOST_OPS.items() if name != "eager")
    host = host_time(rank, CLUSTER, ranks=1)
    assert host.ops == pytest.approx((1000 + other) * 10e-6)
    assert host.framework == pytest.approx(FRAMEWORK_STEP_OPS * 10e-6)
    faster = dataclasses.replace(CLUSTER, host_op_us=5.0)  # a host twice as fast halves every cost
    assert host_time(rank, faster, ranks=1).ops == pytest.approx(host.ops / 2)


def test_a_clusters_own_host_costs_replace_the_cpu_machines():
    """A GPU's eager op includes its launch, so its host's other costs are other multiples of it: a cluster's
    ``host_costs`` price them, the framework's work included; the H200 box's are conf/step_time/roofline.yaml's."""
    rank = dataclasses.replace(device("rank 0", 0, {}), host_ops=HOST_OPS)
    costs = {"compiled_kernels": 1.0, "compiled_calls": 2.0, "dtensor": 3.0, "fsdp_modules": 4.0, "framework_step": 5.0}
    host = host_time(rank, dataclasses.replace(CLUSTER, host_costs=costs), ranks=1)
    assert host.ops == pytest.approx((1000 + 100 * 1.0 + 10 * 2.0 + 50 * 3.0 + 3 * 4.0) * 10e-6)
    assert host.framework == pytest.approx(5.0 * 10e-6)
    assert resolved([*TINY_GPT, "plan=true", "cluster=h200_8x"]).cluster.host_costs["compiled_calls"] == 69.0
    assert resolved([*TINY_GPT, "plan=true", "cluster=cpu_2core"]).cluster.host_costs is None


@pytest.mark.parametrize("step_checks", ["auto", "each_step"])
def test_a_gpu_step_is_the_slower_of_its_host_and_device_plus_what_a_wait_exposes(step_checks):
    """The device computes while the host queues the next kernels: the slower sets the step. Where the host waits
    for the device at each step's end (``step_checks=each_step``), the framework's own work runs while the GPU
    idles, and adds to the step."""
    job = resolved([*TINY_GPT, f"step_checks={step_checks}", "cluster=h200_8x"])
    host = host_time(dataclasses.replace(device("x", 0, {}), host_ops=HOST_OPS), CLUSTER, ranks=1)
    waits = step_checks == "each_step"
    for compute in (10**11, 10**10):  # 2 ms of compute, more than the host's 1.45 ms; then 0.2 ms, less
        rank = dataclasses.replace(device("rank 0", compute, {}), host_ops=HOST_OPS)
        step = predict_step(MemoryPlan([rank], 2**40, "test", False, 1), job, CLUSTER)
        device_seconds = compute / 5e13
        expected = max(device_seconds, host.ops) + host.framework if waits else max(device_seconds, host.total)
        assert step.seconds == pytest.approx(expected)
        assert step.host == pytest.approx(host.total)
        assert step.host_bound == pytest.approx(expected - device_seconds)


def test_a_cpu_step_is_its_host_and_its_compute_one_after_the_other_on_its_share_of_the_cores():
    """A CPU dispatches and computes with the same cores, and its processes split them: two processes each
    compute at half the CPU's rate, and also wait for every collective, their flags' agreement included."""
    cpu = dataclasses.replace(CLUSTER, kind="cpu", collective_latency_us=200.0)
    gather = Link("all_gather", "data_parallel", 2, 1)
    rank = dataclasses.replace(device("rank 0", 10**10, {gather: 4 * 10**9}), host_ops=HOST_OPS)
    job = resolved([*TINY_GPT, "strategy=fsdp", "trainer.devices=2"])
    step = predict_step(MemoryPlan([rank], 2**40, "test", False, 2), job, cpu)
    host = host_time(rank, cpu, ranks=2)
    assert host.framework == pytest.approx((FRAMEWORK_STEP_OPS * 10 + 200) * 1e-6)
    gathered = 200e-6 + 2 * 10**9 / (100 * 10**9)  # half the buffer on the wire, after its latency
    assert step.seconds == pytest.approx(10**10 / 5e13 * 2 + gathered + host.total)
    assert step.host_bound == pytest.approx(host.total)


def test_the_host_speed_is_fitted_only_where_the_rows_pin_it():
    """``benchmarks/step_time.py --refit`` fits ``host_op_us`` on rows: a tiny GPT's step on an H200, which its host
    sets, measured at the throughput the model gives at 30 us an op, gives 30 back; measured faster than the model
    gives at the grid's fastest host (1 us), its least error lies at the grid's end, which pins nothing: None, and
    the caller keeps roofline.yaml's (until 2026-12-07 that fit took 1 us)."""
    from step_time import Row, fit_host, planned

    efficiencies = {"matmul_efficiency": 0.74, "attention_efficiency": 0.36, "bandwidth_efficiency": 0.57}
    overrides = [*TINY_GPT, "cluster=h200_8x", "trainer.devices=1", "trainer.precision=bf16-mixed"]
    row = planned(Row("test", "tiny GPT", 1.0, overrides, over_sequence=False))
    at = {host: row.step({**efficiencies, "host_op_us": host}).tokens_per_device_per_s for host in (1.0, 30.0)}
    assert at[1.0] > 10 * at[30.0]  # the host sets the step
    row.row.published = at[30.0]
    assert fit_host([row], efficiencies) == 30.0
    row.row.published = 2 * at[1.0]
    assert fit_host([row], efficiencies) is None


@pytest.mark.parametrize("layers, width, heads, sequence, vocabulary", [(2, 64, 2, 128, 512), (3, 96, 4, 256, 1024)])
def test_megatrons_published_flop_count_is_the_plans_with_recomputation(layers, width, heads, sequence, vocabulary):
    """benchmarks/step_time.py turns Megatron-LM's published TFLOP/s into tokens/s by the paper's count, 96 B s l h^2
    (1 + s/6h + V/16lh) FLOPs a batch of B sequences under full recomputation. The plan of a GPT so checkpointed
    counts within 3% of it, so a predicted tokens/s and a published TFLOP/s measure the same work. (Less by
    torch's checkpoint stopping its recompute once the backward has all it saved: each block's last matmul, 8 h^2
    FLOPs a token, is not rerun; more by flash attention's backward, 2.5 times its forward where the count has 2.)"""
    from step_time import megatron_tokens_per_s

    model = ["model=gpt", f"model.net.num_layers={layers}", f"model.net.dim={width}", f"model.net.num_heads={heads}"]
    data = ["data=tokens", f"data.vocab_size={vocabulary}", f"data.seq_length={sequence}", "data.batch_size=2"]
    job = resolved([*model, *data, "model.activation_checkpointing=true", "trainer.precision=bf16-mixed"])
    flops_per_token = plan_memory(job, suggest=False).devices[0].flops / (2 * sequence)
    counted = 1e12 / megatron_tokens_per_s(1.0, layers, width, sequence, vocabulary)  # FLOPs a token by the paper
    assert flops_per_token == pytest.approx(counted, rel=0.03)


@pytest.mark.parametrize("norm_type", ["rmsnorm", "fused_rmsnorm"])
def test_torchtitans_llama_as_planned_is_llamas_with_its_rotation_pairs_laid_out_apart(norm_type):
    """benchmarks/torchtitan_llama.py plans torchtitan's rows with its model as it ran (RoPE in complex numbers on
    adjacent pairs, keys and values repeated to every query head, its own RMSNorm or a fused one). It computes
    Llama: a model with its query and key projections' rows of each head reordered from adjacent pairs (2i, 2i + 1)
    into halves (i, i + width / 2), this project's layout, gives the same logits (grouped heads: 4 query heads, 2
    key/value heads), where the rows as they are do not."""
    from torchtitan_llama import TorchtitanLlama

    from project.models import Llama

    shape = dict(vocab_size=61, max_length=16, num_layers=2, dim=64, num_heads=4, num_kv_heads=2, hidden_dim=96)
    torch.manual_seed(0)
    torchtitan = TorchtitanLlama(norm_type, **shape).eval()
    for module in torchtitan.modules():  # weights away from 1, which a norm that forgets them would pass with
        if isinstance(module, torch.nn.RMSNorm):
            torch.nn.init.uniform_(module.weight, 0.5, 1.5)
    width = 64 // 4
    halves = torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])
    weights = {}
    for name, tensor in torchtitan.state_dict().items():
        if name.endswith(("attention.q.weight", "attention.k.weight")):
            heads = tensor.shape[0] // width
            tensor = tensor.view(heads, width, -1)[:, halves].reshape_as(tensor)
        weights[name] = tensor
    llama, unordered = Llama(**shape).eval(), Llama(**shape).eval()
    llama.load_state_dict(weights)
    unordered.load_state_dict(torchtitan.state_dict())
    tokens = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(torchtitan(tokens), llama(tokens))
        assert not torch.allclose(torchtitan(tokens), unordered(tokens), atol=1e-3)  # the rotation's pairs matter


def test_megatrons_gpt_as_planned_gathers_its_norms_outputs_in_half_precision():
    """benchmarks/megatron_gpt.py plans Megatron-LM's rows with its layer norm, whose output keeps its input's half
    precision, where this project's norm under CUDA's autocast returns float32. The tiny GPT (2 blocks) over 2
    data-parallel x 2 tensor-parallel ranks in bf16-mixed (FSDP computes in bf16), fully checkpointed: each norm's
    output that sequence parallelism gathers, 16 x 16 x 128 elements, is 2 bytes an element less (the blocks' four,
    forward and again in the recompute, and the final norm's), and so is each of their gradients it reduce-scatters
    (five); no other collective differs."""
    base = ["model=gpt", "data=tokens", "data.seq_length=16", "data.batch_size=16", "cluster=h100_sxm_8x"]
    base += ["strategy=fsdp", "trainer.devices=4", "strategy.tensor_parallel_size=2", "trainer.precision=bf16-mixed"]
    base += ["model.activation_checkpointing=true"]
    runs = ([], ["model.net._target_=megatron_gpt.MegatronGPT"])  # its model alone: no dropout, sequence parallel
    ours, megatrons = (simulate_devices(resolved([*base, *extra]))[0][0] for extra in runs)
    sequence = 16 * 16 * 128
    differences = {key: ours.collectives[key] - megatrons.collectives[key] for key in ours.collectives}
    assert differences == {
        "all_gather|tensor_parallel|2|1": (2 * 2 * 2 + 1) * sequence * 2,
        "reduce_scatter|tensor_parallel|2|1": (2 * 2 + 1) * sequence * 2,
        "all_gather|data_parallel|2|1": 0,
        "reduce_scatter|data_parallel|2|1": 0,
        "all_reduce|tensor_parallel|2|1": 0,
    }


def test_megatrons_attention_as_planned_is_the_causal_attention_of_flash():
    """benchmarks/megatron_gpt.py's GPT computes attention as Megatron did in 2021 (the scores and probabilities in
    memory); without dropout its logits are this project's GPT's with the same weights, as flash attention computes
    them (float32, the causal mask and the scale applied)."""
    from megatron_gpt import MegatronGPT

    from project.models import GPT

    shape = dict(vocab_size=61, max_length=16, num_layers=2, dim=64, num_heads=4)
    torch.manual_seed(0)
    megatron = MegatronGPT(**shape).eval()
    gpt = GPT(**shape).eval()
    gpt.load_state_dict(megatron.state_dict())
    tokens = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(megatron(tokens), gpt(tokens))
