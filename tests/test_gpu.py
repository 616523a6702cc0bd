"""What only a GPU can show (``pytest -m gpu``; skipped without CUDA). ``make gpu-check`` runs them on a GPU box.

Each run is a real ``python train.py`` on ``cuda:0``, read back from its CSV log. The numbers are held against the
hand-written loop of ``tests/helpers/reference.py`` run on the same GPU, the memory plan against
``torch.cuda.max_memory_allocated``. Figures worth reporting are recorded as junit properties (``record_property``),
which ``make gpu-check`` writes into its tables.
"""

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY_GPT, TINY_LLAMA, run_command, train
from helpers.planned_runs import PLANNED_MODELS, planned_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = ["trainer.accelerator=gpu", "trainer.devices=1", "logger=csv"]
FP32 = ["trainer.precision=32-true", "tf32=false"]  # full float32 matmuls: comparable with the loop at 1e-4
BF16 = ["trainer.precision=bf16-mixed"]
STRATEGIES = ["auto", "ddp", "fsdp", "tensor_parallel"]  # ddp, fsdp and tensor_parallel on one GPU: nccl groups
# bf16 keeps 8 bits of mantissa: each rounding is up to 2^-8 = 0.4% of the value. The run and the loop under the same
# autocast round alike, except FSDP, whose mixed precision computes every op in bf16 (norms included) where autocast
# keeps float32. On the CPU the per-epoch losses of 3 epochs differed by at most 6.4e-4 (fsdp; 2e-5 the others);
# 1e-2, two and a half roundings, leaves room for the GPU kernels' reduction order.
BF16_REL = 1e-2


def series(job_dir: Path, key: str) -> list[float]:
    """``key`` of each epoch, from the run's CSV log (a row per epoch, training and validation together)."""
    with open(job_dir / "csv" / "version_0" / "metrics.csv") as file:
        return [float(row[key]) for row in csv.DictReader(file) if row.get(key)]


def largest_relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def gpu_run(name: str, args: list[str], runs_dir: Path, home: Path) -> tuple[Path, str]:
    job_dir = runs_dir / name
    output = train([*args, *GPU, f"hydra.run.dir={job_dir}"], home).output
    return job_dir, output


@pytest.fixture(scope="module")
def gpt_runs(runs_dir, home):
    """The tiny GPT under each strategy on one GPU, in float32 and bf16-mixed: {(strategy, precision): job dir}."""
    runs = {}
    for strategy in STRATEGIES:
        for precision, overrides in (("fp32", FP32), ("bf16", BF16)):
            job_dir, output = gpu_run(
                f"gpu-{strategy}-{precision}",
                [*TINY_GPT, "data.batch_size=32", f"strategy={strategy}", *overrides],
                runs_dir,
                home,
            )
            if strategy != "auto":
                assert "distributed_backend=nccl" in output, output[-3000:]
            runs[strategy, precision] = job_dir
    return runs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float32_runs_match_the_hand_written_loop_on_the_same_gpu(gpt_runs, reference, strategy, record_property):
    expected = reference([*TINY_GPT, "data.batch_size=32", *FP32], 32, device="cuda").history
    job_dir = gpt_runs[strategy, "fp32"]
    worst = 0.0
    for key in ("train/loss", "val/loss"):
        logged = series(job_dir, key)
        worst = max(worst, largest_relative_difference(logged, [row[key] for row in expected]))
        assert logged == pytest.approx([row[key] for row in expected], rel=1e-4), key
    record_property("largest_relative_difference", worst)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_runs_stay_near_the_loop_under_the_same_autocast(gpt_runs, reference, strategy, record_property):
    """Within BF16_REL of the loop under bf16 autocast, and not equal to float32: bf16 was really used."""
    overrides = [*TINY_GPT, "data.batch_size=32"]
    mixed = reference([*overrides, *BF16], 32, device="cuda", autocast=torch.bfloat16).history
    fp32 = reference([*overrides, *FP32], 32, device="cuda").history
    job_dir = gpt_runs[strategy, "bf16"]
    for key in ("train/loss", "val/loss"):
        logged = series(job_dir, key)
        against_mixed = largest_relative_difference(logged, [row[key] for row in mixed])
        against_fp32 = largest_relative_difference(logged, [row[key] for row in fp32])
        record_property(f"{key} vs bf16 loop", against_mixed)
        record_property(f"{key} vs fp32 loop", against_fp32)
        assert against_mixed <= BF16_REL, (key, logged, mixed)
        assert against_fp32 > 1e-6, (key, "a bf16-mixed run gave float32's numbers")
    mfu = series(job_dir, "perf/mfu")
    record_property("perf/mfu", mfu[-1] if mfu else "not logged")
    # The GPU's bf16 peak is in project/observability/flops.py's table, and no run exceeds it.
    assert len(mfu) == 3 and all(0 < value < 1 for value in mfu), mfu


def test_compiled_blocks_match_eager_and_fused_adamw_steps_on_cuda(gpt_runs, runs_dir, home, record_property):
    """model.compile=true (Triton kernels) against the eager float32 run, both with the language model's AdamW
    (fused: true in its config); the probe confirms the compiled run's ran fused on CUDA parameters."""
    job_dir, _ = gpu_run(
        "gpu-compiled",
        [
            *TINY_GPT,
            "data.batch_size=32",
            *FP32,
            "model.compile=true",
            "+callbacks.fused._target_=helpers.probes.FusedAdamW",
        ],
        runs_dir,
        home,
    )
    eager = gpt_runs["auto", "fp32"]
    for key in ("train/loss", "val/loss"):
        difference = largest_relative_difference(series(job_dir, key), series(eager, key))
        record_property(f"{key} compiled vs eager", difference)
        assert difference <= 1e-4, key
    assert series(job_dir, "probe/fused_adamw_on_cuda") == [1.0] * 3


def test_selective_checkpointing_compiled_matches_the_loop(reference, runs_dir, home, record_property):
    """model.activation_checkpointing=selective with model.compile=true (torchtitan's default recipe), on the tiny
    Llama in float32, against the hand-written loop on the same GPU. Torch 2.11 refused it in the first step (its
    checkpoint asked compile for two dispatch modes; docs/gpu.md)."""
    args = [*TINY_LLAMA, "data.batch_size=32", *FP32]
    job_dir, _ = gpu_run(
        "gpu-selective-compiled",
        [*args, "model.compile=true", "model.activation_checkpointing=selective"],
        runs_dir,
        home,
    )
    expected = reference(args, 32, device="cuda").history
    for key in ("train/loss", "val/loss"):
        difference = largest_relative_difference(series(job_dir, key), [row[key] for row in expected])
        record_property(f"{key} vs loop", difference)
        assert difference <= 1e-4, key


def test_float8_trains_within_its_bound_of_bf16_on_float8_tensor_cores(runs_dir, home, record_property):
    """The tiny Llama compiled on one GPU in bf16-mixed, with and without model.float8 (its matmuls then on float8
    tensor cores, torch._scaled_mm): every epoch's losses within test_float8's bound of the bf16 run's, and not equal
    to them. Needs compute capability 8.9 (H100, H200, L40S); skipped below."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs float8 tensor cores (compute capability 8.9 or more)")
    from test_float8 import LOSS_BOUND

    args = [*TINY_LLAMA, "data.batch_size=32", *BF16, "model.compile=true", "model.float8.small_layers=true"]
    for key, difference in switched_differences("gpu-float8", args, "model.float8.enabled", runs_dir, home).items():
        record_property(f"{key} Float8 vs bf16", difference)
        assert 0 < difference <= LOSS_BOUND, key


def switched_differences(name: str, args: list[str], switch: str, runs_dir: Path, home: Path) -> dict[str, float]:
    """Two GPU runs of ``args``, the boolean ``switch`` false and true: for the training and validation loss, the
    largest relative difference of an epoch's."""
    runs = {
        flag: gpu_run(f"{name}-{flag}", [*args, f"{switch}={flag}"], runs_dir, home)[0] for flag in ("false", "true")
    }
    return {
        key: largest_relative_difference(series(runs["true"], key), series(runs["false"], key))
        for key in ("train/loss", "val/loss")
    }


def test_the_fused_loss_is_torchs_to_bf16_precision_in_less_memory_on_cuda(record_property):
    """``linear_cross_entropy`` at GPT-2 medium's output layer (1024 wide, 50,304 tokens) over 8 x 1024 tokens under
    bf16 autocast, against ``F.cross_entropy`` of ``F.linear``: the loss to float32 rounding, both gradients to bf16's,
    and the forward and backward's peak memory below the plain loss's (its bf16 logits, float32 log-softmax and
    their gradients: about 5 GiB)."""
    from torch.nn import functional as F

    from project.models.linear_cross_entropy import linear_cross_entropy

    generator = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(8, 1024, 1024, device="cuda", generator=generator).requires_grad_()
    weight = (torch.randn(50304, 1024, device="cuda", generator=generator) * 0.02).requires_grad_()
    target = torch.randint(0, 50304, (8, 1024), device="cuda", generator=generator)
    results = {}
    for name in ("plain", "fused"):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if name == "plain":
                loss = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), target.flatten(), reduction="sum")
            else:
                loss = linear_cross_entropy(hidden, weight, target)
        grads = torch.autograd.grad(loss, (hidden, weight))
        results[name] = (loss.detach(), grads, (torch.cuda.max_memory_allocated() - before) / 2**20)
        del loss
    (plain, plain_grads, plain_mb), (fused, fused_grads, fused_mb) = results["plain"], results["fused"]
    record_property("peak MiB plain", plain_mb)
    record_property("peak MiB fused", fused_mb)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-5)
    for got, want in zip(fused_grads, plain_grads):
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    assert fused_mb < plain_mb / 2


def test_the_fused_loss_trains_as_the_plain_one_compiled_in_bf16(runs_dir, home, record_property):
    """The tiny GPT (test_reference's fused runs: 8 chunks a step) compiled in bf16-mixed, with and without
    model.fused_loss: every epoch's losses within BF16_REL (the chunks' bf16 sums of the weight's gradient round
    apart)."""
    args = [*TINY_GPT, "data.vocab_size=96", "data.batch_size=32", *BF16, "model.compile=true"]
    args.append("model.fused_loss_chunk_logits=8192")
    for key, difference in switched_differences("gpu-fused-loss", args, "model.fused_loss", runs_dir, home).items():
        record_property(f"{key} fused vs plain", difference)
        assert difference <= BF16_REL, key


def peak_allocated_mb(args: list[str], name: str, runs_dir: Path, home: Path) -> float:
    job_dir, _ = gpu_run(name, args, runs_dir, home)
    return series(job_dir, "memory/peak_allocated_mb")[-1]


def test_activation_checkpointing_lowers_the_peak_gpu_memory(runs_dir, home, record_property):
    # A GPT whose activations outweigh its weights: 4 blocks of width 256 over 512-token sequences, 16 a batch.
    model = [
        *TINY_GPT,
        "model.net.dim=256",
        "model.net.num_heads=4",
        "model.net.num_layers=4",
        "data.seq_length=512",
        "data.num_train=64",
        "data.num_val=16",
        "data.batch_size=16",
        "trainer.max_epochs=1",
        *BF16,
    ]
    without = peak_allocated_mb(model, "gpu-ac-off", runs_dir, home)
    with_ac = peak_allocated_mb([*model, "model.activation_checkpointing=true"], "gpu-ac-on", runs_dir, home)
    record_property("peak MiB, activation checkpointing off", without)
    record_property("peak MiB, activation checkpointing on", with_ac)
    assert with_ac < 0.8 * without, (with_ac, without)


def test_a_checkpoint_moves_from_the_gpu_to_the_cpu_and_back(runs_dir, home):
    """Two epochs on one device, keeping each epoch's checkpoint; epoch 1 again from epoch 0's checkpoint on the
    other device: the same numbers (float32, tf32 off; 1e-4 for the devices' different kernels). The resumed run
    has the same two epochs to go, so its learning-rate schedule is the straight run's."""
    common = [
        *TINY_GPT,
        "data.batch_size=32",
        *FP32,
        "trainer.max_epochs=2",
        "logger=csv",
        "callbacks.model_checkpoint.save_top_k=-1",
    ]
    on = {device: [f"trainer.accelerator={device}", "trainer.devices=1"] for device in ("gpu", "cpu")}
    for first, second in (("gpu", "cpu"), ("cpu", "gpu")):
        straight, resumed = runs_dir / f"move-{first}-straight", runs_dir / f"move-{first}-to-{second}"
        train([*common, *on[first], f"hydra.run.dir={straight}"], home)
        train(
            [
                *common,
                *on[second],
                f"ckpt_path={straight / 'checkpoints' / 'epoch000.ckpt'}",
                f"hydra.run.dir={resumed}",
            ],
            home,
        )
        for key in ("train/loss", "val/loss"):
            assert series(resumed, key) == pytest.approx(series(straight, key)[1:], rel=1e-4), key


def test_eval_generate_and_init_from_run_on_cuda(runs_dir, home, tmp_path):
    """A GPT trained on text on the GPU: mode=eval of its checkpoint on the GPU logs its last val/loss; python -m
    project.cli.generate on cuda writes what it writes on the CPU (greedy); the checkpoint exported to a Hugging Face
    dir
    and read back with model.init_from evaluates the same."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. the dog sat on the log. " * 400)
    common = [
        "model=gpt",
        "data=text",
        f"data.path={corpus}",
        "data.seq_length=32",
        "model.net.dim=32",
        "model.net.num_heads=2",
        "data.batch_size=16",
        *FP32,
        "print_config=false",
        "~callbacks.progress_bar",
        "+trainer.enable_progress_bar=false",
    ]
    job, _ = gpu_run("gpu-text", [*common, "trainer.max_epochs=2"], runs_dir, home)
    checkpoint = job / "checkpoints" / "last.ckpt"
    last = json.loads((job / "result.json").read_text())["final"]["val/loss"]
    evaluated, _ = gpu_run("gpu-eval", [*common, "mode=eval", f"ckpt_path={checkpoint}"], runs_dir, home)
    assert json.loads((evaluated / "result.json").read_text())["final"]["val/loss"] == pytest.approx(last, rel=1e-5)
    texts = {}
    for device in ("cuda", "cpu"):
        generated = run_command(
            [
                sys.executable,
                "-m",
                "project.cli.generate",
                str(checkpoint),
                "--prompt",
                "the cat",
                "--max-new-tokens",
                "16",
                "--temperature",
                "0",
                "--device",
                device,
            ],
            home,
        )
        assert generated.returncode == 0, generated.output
        texts[device] = generated.stdout
    assert texts["cuda"] == texts["cpu"] and texts["cuda"].startswith("the cat"), texts
    exported = run_command([sys.executable, "-m", "project.cli.export", str(checkpoint), str(tmp_path / "hf")], home)
    assert exported.returncode == 0, exported.output
    initialised, _ = gpu_run(
        "gpu-init-from", [*common, "mode=eval", f"model.init_from={tmp_path / 'hf'}"], runs_dir, home
    )
    assert json.loads((initialised / "result.json").read_text())["final"]["val/loss"] == pytest.approx(last, rel=1e-5)


# The memory plan against the GPU: the runs of tests/helpers/planned_runs.py, with CUDA's kernels simulated
# (project/plan/cuda_kernels.py), as every run on a GPU plans.
PLAN_GOAL = 0.10  # planned peak within 10% of max_memory_allocated


def test_grouped_experts_match_the_loop_on_cuda(record_property):
    """CUDA's grouped-matmul kernel against the loop over the experts (bf16, 16 experts of 512 -> 256, 3,000 rows
    in uneven groups, one empty), both against the same experts in float32: the grouped outputs and gradients are
    no further from float32 than the loop's (within 1.5 times, plus a bf16 rounding of the largest value)."""
    from project.models.moe import grouped_swiglu_experts, looped_swiglu_experts, swiglu_experts

    generator = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.ones(16), 3000, replacement=True, generator=generator).bincount(minlength=16)
    counts[3] = 0
    counts = counts.tolist()
    rows = torch.randn(sum(counts), 512, generator=generator).cuda()
    shapes = [(16, 256, 512), (16, 256, 512), (16, 512, 256)]  # gate, up, down
    weights = [torch.randn(shape, generator=generator).cuda() * 512**-0.5 for shape in shapes]
    cotangent = torch.randn(sum(counts), 512, generator=generator).cuda()

    def outputs_and_grads(function, dtype):
        leaves = [tensor.detach().to(dtype).requires_grad_() for tensor in (rows, *weights)]
        out = function(leaves[0], counts, *leaves[1:])
        out.backward(cotangent.to(dtype))
        return [tensor.float() for tensor in (out, *(leaf.grad for leaf in leaves))]

    exact = outputs_and_grads(looped_swiglu_experts, torch.float32)
    grouped = outputs_and_grads(grouped_swiglu_experts, torch.bfloat16)
    loop = outputs_and_grads(looped_swiglu_experts, torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        auto = swiglu_experts(rows, counts, *weights)
    assert auto.dtype == torch.bfloat16 and torch.equal(auto, grouped_swiglu_experts(rows, counts, *weights))
    for name, truth, ours, theirs in zip(["out", "rows", "gate", "up", "down"], exact, grouped, loop, strict=True):
        error, loop_error = (ours - truth).abs().max().item(), (theirs - truth).abs().max().item()
        record_property(f"{name}: grouped / loop largest error vs float32", f"{error:.3g} / {loop_error:.3g}")
        assert error <= 1.5 * loop_error + truth.abs().max().item() * 2**-8, (name, error, loop_error)
    assert grouped[2][3].abs().sum() == 0  # the empty expert's gradient


@pytest.mark.parametrize(
    "activation_checkpointing", ["false", "selective", "true"], ids=["ac-off", "ac-selective", "ac-on"]
)
@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
@pytest.mark.parametrize("model", PLANNED_MODELS)
def test_the_memory_plan_holds_against_max_memory_allocated(
    model, strategy, activation_checkpointing, runs_dir, home, record_property
):
    args = planned_run(model, strategy, activation_checkpointing)
    name = f"gpu-plan-{model}-{strategy}-ac-{activation_checkpointing}"
    job_dir, _ = gpu_run(name, args, runs_dir, home)
    planned, measured = series(job_dir, "memory/planned_peak_mb")[-1], series(job_dir, "memory/peak_allocated_mb")[-1]
    error = (planned - measured) / measured
    record_property("planned peak MiB", planned)
    record_property("max_memory_allocated MiB", measured)
    record_property("plan error", error)
    assert abs(error) <= PLAN_GOAL, (planned, measured)
