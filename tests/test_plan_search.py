"""``python train.py plan=search``: every layout of the job's devices simulated and ranked by the step-time model,
or left out where its bound shows it slower than the fastest that fits; the simulations cached; a run that does not
fit told the fastest layout that does. (The simulations' shortcuts: ``test_plan_shortcuts.py``.)"""

import re

import pytest
from conftest import TINY_GPT, train

pytestmark = pytest.mark.torch_internals

# The tiny GPT (3 blocks) on 2 simulated H100s: FSDP at 4 per device, so a global batch of 8. Communication is made
# free (NVLink at 10^9 GB/s) and the GPU slow (a GFLOPS on one multiprocessor, which the tiny matmuls fill: each
# step's FLOPs take seconds, beside which the collectives' latency and the memory-bound ops are nothing), so that
# compute and bubbles decide, and the pipelines' bounds leave them out.
SEARCH = [
    *TINY_GPT,
    "model.net.num_layers=3",
    "strategy=fsdp",
    "trainer.devices=2",
    "data.batch_size=4",
    "cluster=h100_sxm_8x",
    "cluster.intra_node_gb_per_s=1e9",
    "cluster.peak_tflops=0.001",
    "cluster.multiprocessors=1",
]
# Written out by hand: DDP's one layout, FSDP alone and over 2 tensor-parallel ranks, a pipeline of 2 ranks under
# 1F1B (4 micro-batches: 2 per rank; interleaving needs 4 stages, and there are 3 blocks), each at the global batch
# of 8 and with activation checkpointing off, selective and full.
LAYOUTS_WITHOUT_BUBBLE = [
    "strategy=ddp data.batch_size=4",
    "strategy=fsdp data.batch_size=4",
    "strategy=fsdp strategy.tensor_parallel_size=2 data.batch_size=8",
]
LAYOUTS = {
    f"{layout} model.activation_checkpointing={checkpointing}"
    for layout in [
        *LAYOUTS_WITHOUT_BUBBLE,
        "strategy=pipeline strategy.num_stages=2 strategy.microbatches=4 data.batch_size=8",
    ]
    for checkpointing in ("false", "selective", "true")
}
ROW = re.compile(r"^\s*(\d+)\s+([\d,]+)\s+([\d.]+)%\s+\S+\s+\S+\s+\S+\s+~?([\d.]+ [KMG]iB)\s+(yes|no)\s+(.+)$", re.M)
BOUNDED = re.compile(r"^\s*\d+\s+<=([\d,]+)(?:\s+-){6}\s+(.+)$", re.M)
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def rows(output: str) -> list[dict]:
    return [
        {
            "tokens": int(tokens.replace(",", "")),
            "mfu": float(mfu) / 100,
            "peak": float(peak.split()[0]) * UNITS[peak.split()[1]],
            "fits": fits == "yes",
            "overrides": overrides.strip(),
        }
        for _, tokens, mfu, peak, fits, overrides in ROW.findall(output)
    ]


@pytest.fixture(scope="module")
def searched(tmp_path_factory, home):
    """The search, pruned, then again with every layout simulated (those the first left out), its simulations
    cached in a cache dir of their own; returns that dir and the two tables."""
    cache = tmp_path_factory.mktemp("search-cache")
    pruned = train([*SEARCH, "plan=search", f"paths.cache_dir={cache}"], home).stdout
    every = train([*SEARCH, "plan=search", "plan_search.prune=false", f"paths.cache_dir={cache}"], home).stdout
    return cache, pruned, every


def test_every_layout_is_ranked_by_predicted_throughput(searched):
    cache, _, output = searched
    table = rows(output)
    assert len(list((cache / "plan_cache").glob("*.json"))) >= len(LAYOUTS)  # paths.cache_dir, not the launch dir
    assert {row["overrides"] for row in table} == LAYOUTS
    assert all(row["fits"] for row in table)  # in an H100's 80 GB
    assert [row["tokens"] for row in table] == sorted((row["tokens"] for row in table), reverse=True)
    assert f"Fastest that fits in 80.00 GiB: {table[0]['overrides']}" in output


def test_a_layout_and_its_checkpointed_twin_have_the_same_model_flops(searched):
    """MFU counts the step's FLOPs but the recompute: a layout with checkpointing and without compute the same
    model FLOPs, so their MFUs stand as their throughputs do."""
    _, _, output = searched
    table = {row["overrides"]: row for row in rows(output)}
    for layout in (overrides for overrides in table if overrides.endswith("checkpointing=true")):
        on, off = table[layout], table[layout.replace("checkpointing=true", "checkpointing=false")]
        assert on["mfu"] < off["mfu"]
        assert on["mfu"] / off["mfu"] == pytest.approx(on["tokens"] / off["tokens"], rel=0.01)


def test_the_layouts_pruned_are_bounded_above_their_throughput_and_none_is_the_fastest(searched):
    """Pruned, the search simulates only the layouts without a bubble: each pipeline's bound (its share of the
    step's FLOPs, stretched by its bubble) is below FSDP's throughput. Simulated after all, each pipeline is slower
    than its bound, and the fastest layout is the same."""
    _, pruned, every = searched
    assert "12 layouts, 9 simulated, 3 bounded" in pruned
    assert "12 layouts, 3 simulated, 0 bounded" in every  # the 3 left out; the 9 others from the cache
    bounds = {overrides.strip(): int(bound.replace(",", "")) for bound, overrides in BOUNDED.findall(pruned)}
    assert set(bounds) == {layout for layout in LAYOUTS if layout.startswith("strategy=pipeline")}
    simulated = {row["overrides"]: row["tokens"] for row in rows(every)}
    assert all(simulated[layout] <= bound for layout, bound in bounds.items())
    assert max(bounds.values()) < rows(pruned)[0]["tokens"]
    fastest = "Fastest that fits in 80.00 GiB: "
    assert pruned.split(fastest)[1].splitlines()[0] == every.split(fastest)[1].splitlines()[0]


@pytest.mark.slow
def test_a_smaller_device_reranks_from_the_cache_and_a_run_that_does_not_fit_is_told_the_fastest_that_does(
    searched, home
):
    """With a device between the smallest and the largest peak, the same search (all from the cache) puts the
    layouts that fit first. ``plan=true`` on one that does not fit names the fastest that does, and on that one
    predicts the throughput the search gave it."""
    cache, _, output = searched
    peaks = sorted(row["peak"] for row in rows(output))
    gigabytes = (peaks[0] + peaks[-1]) / 2 / 2**30
    small = [f"memory_plan.device_memory_gb={gigabytes}", f"paths.cache_dir={cache}"]
    again = train([*SEARCH, "plan=search", *small], home).stdout
    table = rows(again)
    assert "12 layouts, 0 simulated" in again
    fits = [row["fits"] for row in table]
    assert any(fits) and not all(fits) and fits == sorted(fits, reverse=True)
    assert all(row["fits"] == (row["peak"] <= gigabytes * 2**30) for row in table)
    fastest = table[0]
    biggest = max(table, key=lambda row: row["peak"])["overrides"].split()
    refused = train([*SEARCH, *biggest, "plan=true", *small], home).stdout
    assert f"Fastest layout that fits on h100_sxm_8x: {fastest['overrides']}" in refused
    chosen = train([*SEARCH, *fastest["overrides"].split(), "plan=true", *small], home).stdout
    predicted = re.search(r"Predicted on h100_sxm_8x: .*?, ([\d,]+) tokens/s per GPU", chosen)
    assert predicted and int(predicted.group(1).replace(",", "")) == fastest["tokens"]
