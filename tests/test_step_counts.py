"""What the memory plan counts of a training step besides memory (project/accounting/counts.py): its FLOPs, against
arithmetic, and every collective's bytes, against what each rank of a real gloo run of the same layout sent."""

import json
from collections import Counter

import pytest
from conftest import TINY, TINY_GPT
from test_memory_plan import job_dir_of, resolved

from project.accounting.counts import Kernel
from project.job.job import Job
from project.plan.memory_plan import simulate_devices

# Session runs (conftest) whose ranks counted their collectives (COUNTED), each launched after its plan.
COUNTED_RUNS = [
    ("ddp_fsdp_sweep", 0),  # ddp x 2
    ("ddp_fsdp_sweep", 1),  # fsdp x 2
    ("ddp_fsdp_sweep", 2),  # pipeline x 2, 1F1B
    ("pipeline_sweep", 0),  # pipeline x 2, GPipe
    ("gpt_tensor_parallel", None),  # tensor parallel x 2
    ("gpt_fsdp_tensor_parallel", None),  # fsdp x 2 of tensor parallel x 2
    ("gpt_pipeline_tensor_parallel", None),  # pipeline x 2 of tensor parallel x 2
    # A mixture's experts split over 2 ranks (its all-to-alls; every token goes to every expert, so the plan's
    # even routing is the run's), alone and sharded over 2 more.
    ("moe_expert_parallel", 0),
    ("moe_expert_parallel", 1),
    ("moe_pipeline_expert_parallel", None),  # and in a pipeline of 2 stages: its sends too
    pytest.param("llama_float8_sweep", 1, marks=pytest.mark.slow),  # fsdp x 2, Float8 weights gathered in a byte
]


def set_up(batch: dict, first_epoch: int) -> bool:
    """A batch with one-off collectives besides the step's: the first two of a run (DDP rebuilds its buckets in the
    second and broadcasts their order; a pipeline's schedule infers its shapes in the first) and the first of each
    epoch (FSDP gathers again after validation)."""
    return batch["batch"] == 0 or (batch["epoch"] == first_epoch and batch["batch"] == 1)


@pytest.mark.slow
@pytest.mark.parametrize("fixture,index", COUNTED_RUNS)
def test_planned_collective_bytes_equal_what_every_rank_of_a_gloo_run_moved_each_batch(request, fixture, index):
    """The plan simulates one rank per distinct device on the fake process group (a pipeline's each rank, any
    other layout's rank 0); every rank of the real run counted its collectives over gloo in every batch. Each
    batch, on each rank, moved the bytes its plan device predicts, link by link (kind, mesh dimension, ranks);
    the batches with one-off set-up collectives moved at least those."""
    assert_collectives_as_planned(job_dir_of(request, fixture, index))


def assert_collectives_as_planned(job_dir) -> None:
    """What every rank of the run in ``job_dir`` counted (``helpers.probes.CollectiveBytesPerBatch``) against its
    memory plan (also test_model_parallel's pipeline x data parallel run)."""
    plan = json.loads((job_dir / "memory_plan.json").read_text())
    world, devices = plan["world_size"], plan["devices"]
    measured = {int(path.stem.removeprefix("collectives_rank")): path for path in job_dir.glob("collectives_rank*")}
    assert sorted(measured) == list(range(world))
    for rank, path in measured.items():
        device = devices[rank * len(devices) // world]  # the plan's devices: one per pipeline rank, in rank order
        predicted = device["collectives"]
        batches = json.loads(path.read_text())
        steady = [batch["bytes"] for batch in batches if not set_up(batch, batches[0]["epoch"])]
        assert predicted and len(steady) >= 4 and all(counted == predicted for counted in steady), (rank, steady[0])
        for batch in batches:
            assert all(batch["bytes"].get(link, 0) >= size for link, size in predicted.items()), (rank, batch)


MLP_DIMS = [32, 64, 32, 10]  # TINY: 32 features, hidden [64, 32], 10 classes


def mlp_step_flops(batch: int) -> int:
    """A training step's matmul FLOPs: 2 x batch x in x out per layer forward; backward as much again for the
    weights' gradients, and for the inputs' but the first layer's (the data needs none)."""
    layers = [a * b for a, b in zip(MLP_DIMS, MLP_DIMS[1:])]
    forward = 2 * batch * sum(layers)
    return 2 * forward + 2 * batch * sum(layers[1:])


@pytest.mark.parametrize(
    "layout,per_device_batch",
    [([], 64), (["strategy=ddp", "trainer.devices=2"], 64), (["strategy=fsdp", "trainer.devices=4"], 16)],
    ids=["one-device", "ddp-2", "fsdp-4"],
)
def test_planned_flops_of_an_mlp_step_are_its_matmuls_arithmetic(layout, per_device_batch):
    devices, _ = simulate_devices(resolved([*TINY, f"data.batch_size={per_device_batch}", "logger=none", *layout]))
    assert [device.flops for device in devices] == [mlp_step_flops(per_device_batch)]


def test_planned_matmuls_of_an_mlp_step_are_its_layers_shapes():
    """Each Linear of the MLP (fp32, batch 64), as the step-time model prices it: forward, an addmm of bias, input
    and weight; backward, a matmul for the weight's gradient and one for the input's (but the first layer's), each of
    the same three sizes. Every output fits one 128 x 128 tile; its rows are the batch's, but the weight's gradient's,
    whose rows are the layer's outputs."""
    (device,), _ = simulate_devices(resolved([*TINY, "data.batch_size=64", "logger=none"]))
    expected: Counter[str] = Counter()
    for index, (inputs, outputs) in enumerate(zip(MLP_DIMS, MLP_DIMS[1:])):
        flops, sizes = 2 * 64 * inputs * outputs, 64 * inputs + inputs * outputs + 64 * outputs
        expected[Kernel("matmul", flops, 4 * (outputs + sizes), tiles=1, rows=64).key] += 1
        expected[Kernel("matmul", flops, 4 * sizes, tiles=1, rows=outputs).key] += 1
        expected[Kernel("matmul", flops, 4 * sizes, tiles=1, rows=64).key] += 0 if index == 0 else 1
    assert device.kernels == dict(expected)
    assert device.moved_bytes > 0  # the activations, the loss, the optimizer's step


def test_a_pipelines_stages_share_the_whole_models_flops():
    devices, _ = simulate_devices(resolved([*TINY, "data.batch_size=64", "strategy=pipeline", "trainer.devices=2"]))
    assert len(devices) == 2 and all(device.flops > 0 for device in devices)
    assert sum(device.flops for device in devices) == mlp_step_flops(64)


def gpt_step_flops(job: Job, batch: int, checkpointing: str) -> int:
    """The GPT's step: per block 24 d^2 FLOPs a token in its linears (q, k, v, proj: 4 d x d; MLP: d x 4d twice),
    2 x 2 T d a token in attention (scores, then values; torch counts the causal mask's zeros too), and the head's
    2 d V a token. Backward: twice the linears' (weights and inputs), 2.5 times the attention's (torch's formula).
    Full activation checkpointing recomputes each block's forward in backward but for its last linear (the MLP's
    down projection), whose output no gradient needs: torch's recompute stops early. Selective checkpointing keeps
    attention's output and every second matmul's (the block runs q, k, v, proj, up, down: q's, v's and up's): the
    recompute runs k and proj again (2 d^2 a token each), down being past the early stop."""
    net, seq_length = job.model.net.keywords, job.seq_length
    d, layers, tokens, vocab = net["dim"], job.model.num_layers, batch * seq_length, net["vocab_size"]
    linears, attention, head = 24 * d * d * tokens, 4 * tokens * seq_length * d, 2 * tokens * d * vocab
    step = 3 * (layers * linears + head) + 3.5 * layers * attention
    recompute = {
        "false": 0,
        "selective": layers * 2 * (2 * d * d * tokens),
        "true": layers * (16 * d * d * tokens + attention),
    }[checkpointing]
    return int(step + recompute)


@pytest.mark.parametrize("checkpointing", ["false", "selective", "true"], ids=["no-ac", "selective-ac", "ac"])
def test_planned_flops_of_a_gpt_step_are_its_arithmetic_with_activation_checkpointing_recompute(checkpointing):
    """The step's FLOPs, and of them the recompute's, counted apart (MFU leaves it out)."""
    job = resolved([*TINY_GPT, "data.batch_size=16", "logger=none", f"model.activation_checkpointing={checkpointing}"])
    recompute = gpt_step_flops(job, 16, checkpointing) - gpt_step_flops(job, 16, "false")
    counted = [(device.flops, device.recomputed_flops) for device in simulate_devices(job)[0]]
    assert counted == [(gpt_step_flops(job, 16, checkpointing), recompute)]


@pytest.mark.parametrize("layout", [["strategy=tensor_parallel"], ["strategy=fsdp", "strategy.tensor_parallel_size=2"]])
def test_each_tensor_parallel_rank_computes_half_the_gpts_step(layout):
    """Two tensor-parallel ranks split every linear, the attention heads and the head by vocabulary: each computes
    half the step's arithmetic. (DTensor runs each op whole on fake tensors of its own to infer the output's shape:
    those are not counted.)"""
    job = resolved([*TINY_GPT, "data.batch_size=16", "logger=none", "trainer.devices=2", *layout])
    assert [device.flops for device in simulate_devices(job)[0]] == [gpt_step_flops(job, 16, "false") // 2]
