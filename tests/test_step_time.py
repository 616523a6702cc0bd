"""The step-time model (project/plan/step_time.py) on plans whose counts are set by hand, against the same
arithmetic done here step by step: compute at the calibrated share of the peak, ring collectives over the link
their group crosses, data-parallel traffic hidden behind compute up to its length, the pipeline's bubble."""

import pytest
from test_memory_plan import resolved

from project.accounting.counts import Link
from project.job.cluster import Cluster
from project.parallel.dims import ParallelDims
from project.plan.memory_plan import MemoryPlan
from project.plan.simulate import DevicePlan
from project.plan.step_time import predict_step

# Round numbers: 100 TFLOPS at half efficiency is 5e13 FLOP/s; 100 GB/s in a node, 10 GB/s between nodes.
CLUSTER = Cluster("test", 100, 80, 4, 100, 10, 0.5)
PIPELINE = ["model=gpt", "data=tokens", "strategy=pipeline", "trainer.devices=4", "trainer.num_nodes=2"]


def device(name: str, flops: int, collectives: dict[Link, int]) -> DevicePlan:
    return DevicePlan(name, 0, 0, 0, 0, 0, 0, flops=flops, collectives={k.key: v for k, v in collectives.items()})


# Two pipeline ranks of 8 (4 stages of 2 data-parallel ranks, 4 devices a node).
FIRST = device(
    "rank 0",
    10**14,  # 2 s of compute
    {
        Link("all_gather", "data_parallel", 2, 1): 4 * 10**9,  # half on the wire in a node: 0.02 s, hidden
        Link("send", "pipeline", 4, 2): 10**9,  # 1e9 B between nodes: 0.1 s, waited for
    },
)
SECOND = device(
    "rank 1",
    12 * 10**13,  # 2.4 s
    {
        Link("all_reduce", "tensor_parallel", 2, 1): 5 * 10**9,  # 2 x 1/2 x 5e9 B in a node: 0.05 s, waited for
        Link("reduce_scatter", "data_parallel", 2, 2): 60 * 10**9,  # 30e9 B between nodes: 3 s, 0.6 s beyond compute
        Link("send", "pipeline", 4, 2): 10**9,  # 0.1 s
    },
)


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
    busy = 2.4 + 0.05 + 0.1 + (3.0 - 2.4)  # the second rank: compute, tensor parallel, sends, what compute cannot hide
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
    for wire_seconds, step_seconds in ((1.5, 2.0), (2.5, 2.5)):
        size = int(wire_seconds * 100 * 10**9 * 4 / 3)  # an all-gather of 4 ranks puts 3/4 on the wire
        rank = device("rank 0", 10**14, {Link("all_gather", "data_parallel", 4, 1): size})
        step = predict_step(MemoryPlan([rank], 2**40, "test", False, 4), job, CLUSTER)
        assert step.seconds == pytest.approx(step_seconds, rel=1e-6)
