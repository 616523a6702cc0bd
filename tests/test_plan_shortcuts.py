"""The shortcuts that make ``plan=search`` fast, each held to the whole simulation it stands for: a deep model's plan
extended from shallow copies, a pipeline step's repeated micro-batches replayed, a layout simulated only up to the
first moment a device does not fit."""

import json
import re
from dataclasses import asdict, replace

import pytest
from conftest import TINY_GPT
from test_memory_plan import resolved
from test_plan_search import SEARCH

from project.plan import simulate
from project.plan.depth import extrapolated_plan
from project.plan.memory_plan import device_capacity, plan_memory
from project.plan.search import (
    Search,
    _simulate,
    candidate_layouts,
    format_search,
    from_cache,
    rank_layouts,
    set_bounds,
)
from project.plan.step_time import predict_step

pytestmark = pytest.mark.torch_internals

DEEP_GPT = [*TINY_GPT, "model.net.num_layers=13", "data.batch_size=8"]  # 13 blocks: more than copies of 3+4+5


@pytest.mark.parametrize(
    "layout",
    [
        ["strategy=fsdp", "trainer.devices=4"],
        ["strategy=pipeline", "trainer.devices=2", "model.net.num_layers=26", "strategy.microbatches=2"],
    ],
    ids=["fsdp", "pipeline"],
)
def test_a_plan_extended_from_shallow_copies_is_the_whole_simulation(layout):
    """Every figure but the peak is the whole simulation's, exactly: model state, activations, FLOPs and every
    link's bytes are lines in the blocks. The peak is within 3% (under FSDP this tiny GPT's fullest moment moves
    once the model is deeper than the copies: 2.3% under at 13 blocks), which is why plan=search simulates the
    layout it names whole."""
    job = resolved([*DEEP_GPT, *layout])
    extended, whole = extrapolated_plan(job), plan_memory(job, suggest=False)
    assert extended is not None and len(extended.devices) == len(whole.devices)
    for guess, truth in zip(extended.devices, whole.devices):
        assert {**asdict(guess), "peak": 0, "comm_buffers": 0} == {**asdict(truth), "peak": 0, "comm_buffers": 0}
        assert guess.peak == pytest.approx(truth.peak, rel=0.03)


@pytest.mark.parametrize(
    "layout",
    [
        # 1F1B, each stage split over 2 tensor-parallel ranks and sharded over 2 replicas; rank 0 has 2 micro-batches
        # in flight of 6, and replays micro-batches 2 and 3
        ["trainer.devices=8", "strategy.num_stages=2", "strategy.tensor_parallel_size=2", "strategy.microbatches=6"],
        ["trainer.devices=2", "strategy.schedule=gpipe", "strategy.microbatches=6"],  # all in flight
        ["trainer.devices=2", "strategy.num_stages=4", "strategy.stages_per_rank=2"]
        + ["strategy.schedule=interleaved_1f1b", "strategy.microbatches=8", "model.activation_checkpointing=true"],
    ],
    ids=["1f1b-fsdp-tp", "gpipe", "interleaved-checkpointed"],
)
def test_replayed_microbatches_hold_and_count_what_simulated_ones_do(layout, monkeypatch):
    """A pipeline device's plan with its repeated micro-batches replayed is, figure for figure, its plan with every
    micro-batch simulated; but the host's ops, which a replayed micro-batch takes from the second (the others'
    bookkeeping differs by a few ops each, against the step's thousands), to 2%."""
    job = resolved([*TINY_GPT, "model.net.num_layers=4", "data.batch_size=48", "strategy=pipeline", *layout])
    replayed = plan_memory(job, suggest=False)
    monkeypatch.setattr(simulate, "simulated_microbatches", lambda microbatches, in_flight: set(range(microbatches)))
    whole = plan_memory(job, suggest=False)
    figures = [{**asdict(device), "host_ops": None} for device in replayed.devices]
    assert figures == [{**asdict(device), "host_ops": None} for device in whole.devices]
    for device, simulated in zip(replayed.devices, whole.devices, strict=True):
        assert device.host_ops.keys() == simulated.host_ops.keys()
        for kind, count in simulated.host_ops.items():
            assert device.host_ops[kind] == pytest.approx(count, rel=0.02), kind


def test_a_layout_is_simulated_up_to_the_first_moment_a_device_does_not_fit(tmp_path):
    """In a search, a pipeline is simulated only until a device holds more than the capacity. On a device halfway
    between its first rank's model state and peak, that rank stops partway through its step (before its gradients
    are made): the same parameters and optimizer state, a peak above the capacity but below the whole step's, fewer
    FLOPs; the plan is partial, and the second rank is not simulated. Shown, such a plan has its peak as a floor and
    no throughput while no layout was simulated through, its bound once one with its checkpointing was. Its cached
    plan says only that the layout needs more than that peak: a search with a larger device simulates it again."""
    layout = [*SEARCH, "strategy=pipeline", "strategy.num_stages=2", "strategy.microbatches=4", "data.batch_size=8"]
    first, _ = plan_memory(resolved(layout), suggest=False).devices
    capacity = (first.model_state + first.peak) // 2
    stopped = plan_memory(
        resolved([*layout, f"memory_plan.device_memory_gb={capacity / 2**30}"]), suggest=False, stop_over_capacity=True
    )
    assert stopped.partial and [device.name for device in stopped.devices] == [first.name]
    (device,) = stopped.devices
    assert (device.params, device.optimizer) == (first.params, first.optimizer)
    assert capacity < device.peak < first.peak and device.flops < first.flops

    # The search's own steps, in this process: its three pipelines (checkpointing off, selective and full) on a
    # 100 KiB device.
    job = resolved([*SEARCH, "plan_search.strategies=[pipeline]", "memory_plan.device_memory_gb=0.0001"])
    layouts, small, cache = list(candidate_layouts(job)), device_capacity(job)[0], tmp_path / "plan_cache"
    for name, same in from_cache(layouts, cache, small).items():
        (cache / name).write_text(json.dumps(_simulate(same[0].job, whole=False)))
    assert from_cache(layouts, cache, small) == {} and all(found.plan and found.plan.partial for found in layouts)
    cluster = job.cluster
    assert cluster is not None
    table = format_search(job, Search(rank_layouts(layouts, cluster, small), [], cluster, small))
    assert len(re.findall(r"^\s*\d+(?:\s+-){5}\s+>=[\d.]+ KiB\s+no\s", table, re.M)) == 3
    assert len(from_cache(layouts, cache, 80 * 2**30)) == 3  # more memory: all to simulate again

    # Bounded once a layout with the same checkpointing has been simulated through: here the pipeline without
    # checkpointing itself, whole. Its bound is above the throughput it gets whole; its twins' stay unknown.
    off, *others = sorted(layouts, key=lambda layout: "checkpointing=false" not in layout.overrides)
    through = replace(off, plan=plan_memory(off.job, suggest=False))
    set_bounds([*layouts, through], cluster)
    assert off.bound is not None and len(others) == 2 and all(other.bound is None for other in others)
    assert off.bound >= predict_step(through.plan, off.job, cluster).tokens_per_device_per_s
    table = format_search(job, Search(rank_layouts(layouts, cluster, small), [], cluster, small))
    row = rf"^\s*1\s+<={off.bound:,.0f}(?:\s+-){{4}}\s+>=[\d.]+ KiB\s+no\s+{re.escape(off.overrides)}$"
    assert re.search(row, table, re.M)
