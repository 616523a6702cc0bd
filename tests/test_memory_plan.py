"""The memory plan (``project/plan/memory_plan.py``): what it predicts against what real runs measure, plans of 1024
simulated ranks against arithmetic, and the plan as a guard before launch (its refusals are in test_bad_input)."""

import csv
import math
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
import omegaconf
import pytest
from conftest import TINY, TINY_GPT, only_run, train
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict
from test_config import compose_train

from project.config.build import build_job, build_strategy, layout_of, model_of, strategy_option_layout, with_strategy
from project.job.job import Job
from project.job.rules import layout_problem
from project.layouts.fsdp_layout import FSDPLayout
from project.parallel.parallelize import block_sizes, split_blocks, stage_modules
from project.plan.memory_plan import candidate_changes, plan_memory
from project.plan.search import Candidate, candidate_layouts

pytestmark = pytest.mark.torch_internals

MODEL_STATE = ("params", "grads", "optimizer", "model_state")

# Session runs of every strategy (conftest), each launched after its plan: (fixture, job index or None).
PLANNED_RUNS = [
    ("single_run", None),
    ("ddp_fsdp_sweep", 0),
    ("ddp_fsdp_sweep", 1),
    ("ddp_fsdp_sweep", 2),
    ("model_parallel_run", None),
    ("pipeline_sweep", 0),
    ("pipeline_sweep", 1),
    ("gpt_auto", None),
    ("gpt_ddp_fsdp_sweep", 0),
    ("gpt_ddp_fsdp_sweep", 1),
    ("gpt_fsdp_selective", None),
    ("gpt_split_selective_sweep", 0),
    ("gpt_split_selective_sweep", 1),
    ("gpt_pipeline_compiled", None),
    ("llama_auto", None),
    ("llama_fsdp", None),
    ("llama_split_sweep", 0),
    ("llama_split_sweep", 1),
    ("gpt_tensor_parallel", None),
    ("gpt_fsdp_tensor_parallel", None),
    ("gpt_pipeline_tensor_parallel", None),
    ("llama_tensor_parallel", None),
    ("mlp_tensor_parallel", None),
    ("gpt_lora_auto", None),  # LoRA: frozen weights have no gradients and no optimizer state
    ("gpt_lora_fsdp", None),
    ("gpt_lora_tensor_parallel", None),
    # Runs no fast test starts otherwise (the slow reference comparisons do): make test-fast leaves them out.
    *(
        pytest.param(*run, marks=pytest.mark.slow)
        for run in [
            ("llama_qlora_auto", None),  # QLoRA: the base in NF4, sharded in 4 bits under fsdp
            ("llama_qlora_sweep", 0),
            ("llama_qlora_sweep", 1),
            ("llama_qlora_sweep", 2),
            ("moe_auto", None),  # a mixture of experts: the plan routes evenly, the runs as their routers choose
            ("moe_sweep", 0),
            ("moe_sweep", 1),
            ("moe_sweep", 2),
            ("moe_expert_parallel", 0),  # experts split over 2 ranks: the plan's all-to-alls route evenly
            ("moe_expert_parallel", 1),
            ("moe_pipeline_expert_parallel", None),  # ... in each stage of a pipeline
            ("gpt_fused_sweep", 0),  # the fused loss: no logits held, the gradients of its output layer instead
            ("gpt_fused_sweep", 1),
            ("gpt_fused_model_parallel", None),
            ("llama_float8_sweep", 0),  # fsdp x 2 in bf16-mixed...
            ("llama_float8_sweep", 1),  # ...and in Float8: float8 copies saved for backward, weights gathered in a byte
        ]
    ),
]
# The runs that also tracked the peak of their first two steps (callbacks.memory.tracked_steps=2). Not
# model_parallel, whose stages share the one CPU, nor the compiled pipeline: under the tracker (a dispatch mode) a
# compiled block saves what eager autograd saves, which its plan does not.
TRACKED_RUNS = [
    run
    for run in PLANNED_RUNS
    if getattr(run, "values", run)[0]
    not in ("model_parallel_run", "gpt_pipeline_compiled", "llama_auto", "gpt_fused_model_parallel")
    and run != ("llama_split_sweep", 0)
]


def job_dir_of(request, fixture: str, index: int | None):
    """The job dir of a one-run fixture, or of job ``index`` of a sweep fixture (which returns jobs 0 and 1)."""
    value = request.getfixturevalue(fixture)
    return value if index is None else value[0].parent / str(index)


@pytest.mark.parametrize("fixture,index", PLANNED_RUNS)
def test_planned_model_state_equals_the_measured_byte_for_byte(request, fixture, index):
    """Parameters, gradients and optimizer state of the plan (simulated on fake tensors before launch) are what
    the run's devices held (counted on the real tensors each epoch): equal floats of bytes / 2**20, so equal bytes."""
    run = only_run(job_dir_of(request, fixture, index))
    for part in MODEL_STATE:
        planned, measured = run.series(f"memory/planned_{part}_mb"), run.series(f"memory/{part}_mb")
        assert planned == measured and measured[0] > 0, part


@pytest.mark.parametrize("fixture,index", TRACKED_RUNS)
def test_planned_peak_is_within_15_percent_of_the_tracked_peak(request, fixture, index):
    """The peak the plan predicts, against the peak of the run's first two training steps, tracked on its real
    tensors (every rank; the most of any is logged)."""
    run = only_run(job_dir_of(request, fixture, index))
    planned, tracked = run.series("memory/planned_peak_mb")[0], run.series("memory/tracked_peak_mb")[0]
    assert abs(planned - tracked) <= 0.15 * tracked, (planned, tracked)


# GPT-3 XL on 8 devices x 128 nodes, with a short sequence so that each simulated step is quick.
LARGE = [
    "model=gpt_1_3b",
    "data=tokens",
    "data.vocab_size=50257",
    "data.seq_length=64",
    "data.batch_size=8",
    "data.num_train=100000",
    "data.num_val=2048",
    "trainer.devices=8",
    "trainer.num_nodes=128",
    "logger=none",
]
RANKS = 1024


def resolved(overrides: list[str]) -> Job:
    """The typed job of the composed config, resolved, as the launcher builds it, without the run's checks (some of
    these plans are of jobs no machine here could run)."""
    cfg = compose_train(overrides)
    with open_dict(cfg):
        del cfg["hydra"]
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    data = instantiate(cfg.data)
    layout = layout_of(build_strategy(cfg.strategy), cfg.strategy)
    return build_job(cfg, layout, model_of(cfg), None, data)


def sharded_bytes(parameters, shards: int) -> int:
    """FSDP2 cuts each parameter's dimension 0 into ``shards`` chunks of ceil(rows / shards) rows (the last ones
    shorter or empty): rank 0 holds a full chunk of every parameter, 4 bytes per float32 value."""
    return sum(math.ceil(p.shape[0] / shards) * p[0].numel() * 4 for p in parameters)


def adamw_bytes(parameter_bytes: int, parameters: list) -> int:
    """AdamW's state: two moments the size of the parameters, and a float32 step count per parameter."""
    return 2 * parameter_bytes + 4 * len(parameters)


def test_fsdp_and_ddp_plans_of_1024_ranks_hold_what_arithmetic_says():
    net_parameters = list(resolved([*LARGE, "strategy=fsdp"]).meta_net().parameters())
    assert sum(p.numel() for p in net_parameters) > 1.3e9
    fsdp = plan_memory(resolved([*LARGE, "strategy=fsdp"]), suggest=False)
    rank0 = fsdp.devices[0]
    expected = sharded_bytes(net_parameters, RANKS)
    assert fsdp.world_size == RANKS and [d.name for d in fsdp.devices] == ["rank 0"]
    assert rank0.params == rank0.grads == expected
    assert rank0.optimizer == adamw_bytes(expected, net_parameters)

    ddp = plan_memory(resolved([*LARGE, "strategy=ddp"]), suggest=False).devices[0]
    full = sum(p.numel() for p in net_parameters) * 4
    assert ddp.params == ddp.grads == full and ddp.optimizer == adamw_bytes(full, net_parameters)
    assert ddp.comm_buffers == full  # the gradients live in DDP's all-reduce buckets (gradient_as_bucket_view)
    assert ddp.activations == rank0.activations  # the same micro-batch through the same blocks
    assert ddp.peak > rank0.peak + 3 * full  # what sharding saves


@pytest.mark.parametrize(
    "model",
    [
        ["model=llama_1b", "data=tokens", "data.vocab_size=128256", "data.seq_length=64"],
        ["experiment=seed_large_model", "data.batch_size=8"],
    ],
    ids=["llama_1b", "seed_mlp"],
)
def test_fsdp_plans_of_1024_ranks_of_the_other_models(model):
    job = resolved([*model, "strategy=fsdp", "trainer.devices=8", "trainer.num_nodes=128", "logger=none"])
    parameters = list(job.meta_net().parameters())
    plan = plan_memory(job, suggest=False)
    expected = sharded_bytes(parameters, RANKS)
    assert plan.world_size == RANKS and plan.devices[0].params == plan.devices[0].grads == expected


def test_fsdp_x_tensor_parallel_plan_of_1024_ranks_shards_each_split_again():
    """Llama 3.2 1B (2 of its 16 blocks) as 128 FSDP replicas of 8 tensor-parallel ranks: each parameter is first
    split as its plan says (query/key/value, gate and up projections and the vocabulary tables by rows, attention
    output and down projections by columns, norms whole), then FSDP cuts rank 0's split into ceil(rows / 128) rows.
    The tied output layer is the token table, held once."""
    job = resolved(
        [
            "model=llama_1b",
            "model.net.num_layers=2",
            "data=tokens",
            "data.vocab_size=128256",
            "data.seq_length=64",
            "data.batch_size=8",
            "strategy=fsdp",
            "strategy.tensor_parallel_size=8",
            "trainer.devices=8",
            "trainer.num_nodes=128",
            "logger=none",
        ]
    )
    replicas, split = 128, 8
    expected = 0
    for name, parameter in job.meta_net().named_parameters():  # a tied weight once, under its first name
        rows, columns = parameter.shape[0], parameter[0].numel()
        if name.endswith(("q.weight", "k.weight", "v.weight", "gate.weight", "up.weight", "tokens.weight")):
            rows //= split
        elif name.endswith(("o.weight", "down.weight")):
            columns //= split
        expected += math.ceil(rows / replicas) * columns * 4
    rank0 = plan_memory(job, suggest=False).devices[0]
    assert rank0.params == rank0.grads == expected


def plan_of_stages(overrides: list[str]) -> tuple:
    """The plan of a config that splits the model into 8 stages, and each stage's parameters (on the meta device)."""
    job = resolved(overrides)
    net = job.meta_net()
    stages = split_blocks(block_sizes(net), 8, None)
    parameters = [
        [p for module in stage_modules(net, stages, stage) for p in module.parameters()] for stage in range(8)
    ]
    return plan_memory(job, suggest=False), parameters


def test_pipeline_plan_of_1024_ranks_keeps_each_stage_sharded_and_1f1b_in_flight():
    """8 stages x 128 data-parallel replicas: each pipeline rank holds its stage sharded 128 ways, and under
    1F1B rank r keeps the activations of 8 - r micro-batches at once (GPipe: all 8). GPT-3 XL's width, 8 of its
    24 blocks: one per stage."""
    overrides = [
        *LARGE,
        "strategy=pipeline",
        "strategy.num_stages=8",
        "strategy.microbatches=8",
        "model.net.tie_weights=false",
        "model.net.num_layers=8",
    ]
    plan, stage_parameters = plan_of_stages(overrides)
    assert [device.name for device in plan.devices] == [f"rank {r} (stage {r})" for r in range(8)]
    for rank, device in enumerate(plan.devices):
        assert device.params == sharded_bytes(stage_parameters[rank], RANKS // 8), rank
    # Ranks 1..6 run equal stages (a block each): activations in proportion to the micro-batches in flight.
    activations = [device.activations for device in plan.devices]
    assert len({len(stage_parameters[r]) for r in range(1, 7)}) == 1
    for rank in range(1, 6):
        assert activations[rank] * (8 - rank - 1) == activations[rank + 1] * (8 - rank)
    gpipe = plan_memory(resolved([*overrides, "strategy.schedule=gpipe"]), suggest=False)
    assert gpipe.devices[3].activations == activations[3] * 8 // (8 - 3)


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_a_pipeline_of_tensor_parallel_llama_stages_lays_out_each_rank(model):
    """Each rank's stage gets the family's tensor-parallel plan (Qwen 3's per-head norms included) from the blocks
    it keeps: a later stage's first block is not one of them."""
    job = resolved(
        [
            f"model={model}",
            "data=tokens",
            "strategy=pipeline",
            "strategy.num_stages=2",
            "strategy.tensor_parallel_size=2",
            "trainer.devices=4",
        ]
    )
    plan = plan_memory(job, suggest=False)
    assert [device.name for device in plan.devices] == ["rank 0 (stage 0)", "rank 1 (stage 1)"]
    assert all(device.params > 0 for device in plan.devices)


def test_a_pipelines_last_stage_keeps_no_outputs_so_its_plan_is_flat_in_the_micro_batch_count():
    """The last stage feeds the metrics one micro-batch at a time: at 32 micro-batches of 4 samples it holds what it
    holds at 4 (a micro-batch's logits are 8 KiB here; what grows is torch's bookkeeping, 512 bytes a micro-batch, and
    the receive buffers torch's stages allocate per micro-batch, counted as comm buffers)."""
    plans = {
        count: plan_memory(
            resolved(
                [
                    *TINY_GPT,
                    "model.net.num_layers=4",
                    f"data.batch_size={4 * count}",
                    "strategy=pipeline",
                    "trainer.devices=2",
                    f"strategy.microbatches={count}",
                ]
            ),
            suggest=False,
        )
        for count in (4, 32)
    }
    few, many = (plans[count].devices[-1] for count in (4, 32))
    logits = 4 * 16 * 32 * 4  # a micro-batch's: samples x positions x vocabulary x float32
    assert many.activations - few.activations <= 28 * 512 < 28 * logits
    assert many.peak - many.comm_buffers - (few.peak - few.comm_buffers) <= 28 * 512 * 2


@pytest.mark.parametrize("devices", [1, 2], ids=["auto", "fsdp_x2"])
def test_a_bf16_true_plan_holds_two_bytes_a_parameter(devices):
    """trainer.precision=bf16-true, which the plan used to crash on ("Couldn't swap Linear.weight"): the model
    converted, 2 bytes a parameter, each of fsdp's 2 ranks half of them (every TINY layer splits evenly)."""
    strategy = ["strategy=fsdp", f"trainer.devices={devices}"] if devices > 1 else []
    job = resolved([*TINY, "trainer.precision=bf16-true", *strategy])
    parameters = sum(parameter.numel() for parameter in job.meta_net().parameters())
    (device, *_) = plan_memory(job, suggest=False).devices
    assert device.params == device.grads == 2 * parameters // devices


def test_model_parallel_plan_holds_each_stage_on_its_device():
    plan, stage_parameters = plan_of_stages(
        [*LARGE, "strategy=model_parallel", "trainer.num_nodes=1", "model.net.tie_weights=false"]
    )
    assert [device.name for device in plan.devices] == [f"stage {s}" for s in range(8)]
    for stage, device in enumerate(plan.devices):
        assert device.params == sum(p.numel() for p in stage_parameters[stage]) * 4


# The tiny GPT on one device: a peak of 2.7 MiB, 1.7 MiB with activation checkpointing, so that 2 MiB devices
# hold it only with checkpointing (the refusal itself, under ddp, is a case of test_bad_input).
SMALL_DEVICE = [
    *TINY_GPT,
    "memory_plan.device_memory_gb=0.002",
    "trainer.max_epochs=1",
    "+trainer.limit_train_batches=2",
    "+trainer.limit_val_batches=1",
    "logger=csv",
]


def test_selective_checkpointing_is_planned_between_none_and_full():
    """What the plan holds for backward, and its peak: less than without checkpointing, more than with full."""
    plans = [
        plan_memory(
            resolved([*TINY_GPT, "data.batch_size=16", "logger=none", f"model.activation_checkpointing={mode}"]),
            suggest=False,
        ).devices[0]
        for mode in ("false", "selective", "true")
    ]
    none, selective, full = plans
    assert none.activations > selective.activations > full.activations
    assert none.peak > selective.peak > full.peak


def test_the_fused_loss_plan_keeps_no_logits():
    """A GPT whose vocabulary (32768) is 512 times its width, in bf16-mixed, 32 x 1024 tokens a step, planned with and
    without model.fused_loss. For backward, the plain loss keeps its log-softmax (4 bytes for each of the tokens x
    vocab logits) and the output Linear its bf16 copy of the weight (2 bytes a weight); the fused one keeps the
    output layer's float32 gradient instead (4 bytes a weight). Both keep the hidden states in bf16 (the Linear's
    input; the fused loss's gradient of them). And nll_loss keeps its total weight, a float32 scalar. The peak: the
    plain loss's whole logits in bf16 and float32 and their gradients against one of the fused loss's 4 chunks."""
    tokens, vocab, dim = 32 * 1024, 32768, 64
    args = [
        *TINY_GPT,
        f"data.vocab_size={vocab}",
        "data.seq_length=1024",
        "data.batch_size=32",
        "data.num_train=64",
        "data.num_val=32",
        f"model.net.dim={dim}",
        "trainer.precision=bf16-mixed",
        "logger=none",
    ]
    plain, fused = (
        plan_memory(resolved([*args, f"model.fused_loss={fused}"]), suggest=False).devices[0]
        for fused in ("false", "true")
    )
    assert plain.activations - fused.activations == tokens * vocab * 4 + vocab * dim * 2 + 4 - vocab * dim * 4
    assert plain.params == fused.params
    assert fused.peak < plain.peak / 2  # 4.26 GiB against 12.2 GiB when written


def test_fsdps_layout_is_the_same_for_any_devices():
    """The memory plan's suggestions of FSDP over more devices and nodes take FSDP's layout for the job's devices
    (its file built once) to those devices: right only while conf/strategy/fsdp.yaml puts no device count into it."""
    assert strategy_option_layout("fsdp", 2) == strategy_option_layout("fsdp", 8) == strategy_option_layout("fsdp", 5)


def test_a_suggested_strategy_is_set_as_its_config_file_sets_it():
    """A DDP run's suggestions include FSDP over the same devices, its options read from conf/strategy/fsdp.yaml."""
    changes = dict(candidate_changes(resolved([*TINY, "strategy=ddp", "trainer.devices=2", "logger=none"])))
    fsdp = changes["strategy=fsdp"]
    assert isinstance(fsdp.layout, FSDPLayout) and fsdp.strategy_name == "fsdp" and fsdp.processes_per_node == 2
    assert fsdp.layout.reshard_after_forward is True


def test_the_suggested_change_fits_and_trains(tmp_path, home):
    result = train([*SMALL_DEVICE, "model.activation_checkpointing=true", f"hydra.run.dir={tmp_path / 'job'}"], home)
    assert "per device fits in 2.0 MiB (memory_plan.device_memory_gb)" in result.output
    assert (tmp_path / "job" / "result.json").is_file()


def test_if_over_warn_trains_a_run_predicted_not_to_fit(tmp_path, home):
    # Tracking more steps than the epoch has: the tracker stops with the epoch and logs what it saw.
    result = train(
        [
            *SMALL_DEVICE,
            "memory_plan.if_over=warn",
            "callbacks.memory.tracked_steps=5",
            f"hydra.run.dir={tmp_path / 'job'}",
        ],
        home,
    )
    assert "does NOT fit in 2.0 MiB" in result.output
    assert "Training anyway (memory_plan.if_over=warn)" in result.output
    with open(tmp_path / "job" / "csv" / "version_0" / "metrics.csv") as file:
        (row,) = list(csv.DictReader(file))
    assert float(row["memory/tracked_peak_mb"]) > float(row["memory/model_state_mb"]) > 0


def test_plan_true_prints_the_plan_and_trains_nothing(tmp_path, home):
    job_dir = tmp_path / "job"
    result = train(
        [
            *TINY_GPT,
            "plan=true",
            "strategy=pipeline",
            "trainer.devices=2",
            "memory_plan.device_memory_gb=1",
            f"hydra.run.dir={job_dir}",
        ],
        home,
    )
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("Memory plan: model=gpt strategy=pipeline"))
    assert "2 device(s) x 1 node(s) = 2 process(es)" in header
    assert any(line.strip().startswith("rank 0 (stage 0)") for line in lines)
    assert any(line.strip().startswith("rank 1 (stage 1)") for line in lines)
    assert "activations (AC on)" in result.stdout  # the other activation checkpointing setting, side by side
    assert "per device fits in 1.00 GiB (memory_plan.device_memory_gb)." in result.stdout
    for trained in ("workers", "checkpoints", "result.json", "config.yaml", "wandb", "memory_plan.json"):
        assert not (job_dir / trained).exists(), trained


def test_a_searched_mixture_tries_each_expert_parallel_size_in_fsdp_and_in_pipelines():
    """The tiny mixture (4 experts) on 8 devices of a node: FSDP and each pipeline try every expert-parallel size
    that divides the experts and the layout's data-parallel ranks; a dense model tries none."""

    def sizes(overrides: list[str]) -> set[tuple[int, int, int]]:
        """(pipeline ranks, tensor-parallel size, expert-parallel size) of each layout the search tries."""
        job = resolved(["data=tokens", "trainer.devices=8", "data.batch_size=2", *overrides])
        dims = (change.job.dims for change in job.layout.search_space(job, 16))
        return {(dim.pipeline, dim.tensor_parallel, dim.expert_parallel) for dim in dims}

    fsdp = sizes(["model=moe", "strategy=fsdp"])  # replicas: 8 / tensor-parallel size
    assert fsdp == {(1, 1, 1), (1, 1, 2), (1, 1, 4), (1, 2, 1), (1, 2, 2), (1, 2, 4), (1, 4, 1), (1, 4, 2), (1, 8, 1)}
    pipelines = sizes(["model=moe", "strategy=pipeline", "plan_search.max_pipeline_ranks=4"])
    assert {(2, 1, 1), (2, 1, 2), (2, 1, 4), (4, 1, 1), (4, 1, 2)} <= pipelines  # 4 and 2 replicas
    assert (4, 1, 4) not in pipelines and all(ep * pp * tp <= 8 for pp, tp, ep in pipelines)
    assert {ep for _, _, ep in sizes(["model=llama", "strategy=pipeline"])} == {1}


def library_calls(library_dirs: tuple[str, ...], work: Callable[[], object]) -> int:
    """How many functions of the libraries under ``library_dirs`` ``work()`` calls, counted by a profile hook."""
    calls = 0

    def profile(frame, event, arg) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(library_dirs):
            calls += 1

    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(None)
    return calls


def test_the_planner_tries_layouts_without_hydra_or_omegaconf():
    """Once each strategy option's layout is built (from its file, once) and the model checked, trying every layout
    of plan=search and simulating one runs no code of Hydra's or OmegaConf's: the candidates are typed jobs."""
    job = resolved([*TINY_GPT, "trainer.devices=4", "data.batch_size=8", "logger=none"])
    libraries = tuple(str(Path(module.__file__).parent) for module in (hydra, omegaconf))
    for name in job.search.strategies:
        layout_problem(with_strategy(job, name))
    candidates: list[Candidate] = []
    assert library_calls(libraries, lambda: candidates.extend(candidate_layouts(job))) == 0
    assert len(candidates) > 10
    assert {candidate.job.strategy_name for candidate in candidates} == {"ddp", "fsdp", "pipeline"}
    pipeline = next(candidate.job for candidate in candidates if candidate.job.strategy_name == "pipeline")
    assert library_calls(libraries, lambda: plan_memory(pipeline, suggest=False)) == 0
    assert library_calls(libraries, lambda: list(candidate_changes(pipeline))) == 0
