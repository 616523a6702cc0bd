"""Float8 training (``model.float8``, project/models/float8.py): the layers converted against the rule, torchao's
emulated matmuls against float8 casts written out by hand, the plan's float8 kernels and gathers against arithmetic,
Float8 split by tensor parallelism against one device's, and fsdp runs in bf16 and in Float8 against each other,
resumed and exported. (The bad-input cases: test_bad_input.)"""

import json
import math
import sys

import pytest
import torch
from conftest import FLOAT8, TINY_LLAMA_TP, run_command, train
from safetensors.torch import load_file
from test_memory_plan import resolved

from project.accounting.counts import Kernel
from project.checkpointing.files import model_state
from project.models import GPT, Llama, MoE
from project.models.float8 import convert_to_float8, float8_layers
from project.parallel.parallelize import materialize
from project.plan.memory_plan import simulate_devices
from project.plan.step_time import kernel_seconds

pytestmark = pytest.mark.torch_internals

float8 = pytest.importorskip("torchao.float8")
Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# Per-epoch loss of the Float8 run against the bf16 one. e4m3 keeps 3 mantissa bits: each operand of each matmul is
# rounded by up to 2^-4 (6%) of its value. Those roundings are independent, so a dot product of K terms is off by
# about 6% / sqrt(K) of its size: 1.1% at the tiny Llama's narrowest (K = 32), and each epoch's loss, a mean over
# 4,096 tokens' log-probabilities, moves less than its inputs do. So 1%: what rounding alone explains stays under it,
# and a cast to the wrong format or a scale off by a power of two (a whole bit of every operand) goes well over.
LOSS_BOUND = 0.01


def block_linears(net) -> set[str]:
    return {name for name, module in net.named_modules() if isinstance(module, Float8Linear)}


def test_float8_converts_the_blocks_linear_layers_of_widths_in_sixteens_and_no_router_stem_or_head():
    """The rule, layer by layer: a Llama whose SwiGLU is 40 wide keeps its gate, up and down projections (40 is
    no multiple of 16) but converts q, k, v and o; a GPT's output layer and embedding stay; a mixture's routers and
    experts stay while its attention and dense block's layers convert."""
    with torch.device("meta"):
        llama = Llama(vocab_size=32, max_length=16, num_layers=2, dim=32, num_heads=2, num_kv_heads=1, hidden_dim=40)
        gpt = GPT(vocab_size=32, max_length=16, num_layers=1, dim=32, num_heads=2)
        moe = MoE(vocab_size=32, max_length=16, num_layers=2, dim=32, num_heads=2, num_kv_heads=1, hidden_dim=64,
                  num_experts=16, experts_per_token=2, expert_hidden_dim=32, first_dense_layers=1)  # fmt: skip
    names = convert_to_float8(llama, "tensorwise", emulate=True, gather_in_float8=False, small_layers=True)
    expected = {f"blocks.{i}.attention.{layer}" for i in range(2) for layer in ("q", "k", "v", "o")}
    assert set(names) == block_linears(llama) == expected
    layers = ("attention.q", "attention.k", "attention.v", "attention.proj", "mlp.up", "mlp.down")
    assert convert_to_float8(gpt, "rowwise", emulate=True, gather_in_float8=False, small_layers=True) == [
        f"blocks.0.{layer}" for layer in layers
    ]
    assert not isinstance(gpt.head.output, Float8Linear)
    names = set(convert_to_float8(moe, "tensorwise", emulate=True, gather_in_float8=False, small_layers=True))
    dense = {f"blocks.0.mlp.{layer}" for layer in ("gate", "up", "down")}
    attention = {f"blocks.{i}.attention.{layer}" for i in range(2) for layer in ("q", "k", "v", "o")}
    assert names == block_linears(moe) == attention | dense  # the router (16 wide: it would pass) stays
    assert "blocks.1.mlp.router" in dict(moe.named_modules())


def test_by_default_float8_leaves_the_layers_torchao_measured_faster_in_bf16():
    """The size rule on real shapes, from torchao's H100 measurements. Tensorwise leaves a layer whose input is at
    most 4096 wide and output at most 1024: of Llama-3.2-1B's (width 2048, 8 key/value heads of 64, SwiGLU 8192) the
    key and value projections (2048 -> 512); of GPT-2 medium's (width 1024) all but the MLP's first layer (1024 ->
    4096; its second, 4096 -> 1024, is small). Rowwise also leaves the query and output projections (2048 -> 2048)
    and the SwiGLU's down projection (8192 -> 2048), and all of GPT-2 medium's (its widest input is 1024)."""
    with torch.device("meta"):
        llama = Llama(vocab_size=128256, max_length=16, num_layers=1, dim=2048, num_heads=32, num_kv_heads=8,
                      hidden_dim=8192)  # fmt: skip
        gpt = GPT(vocab_size=50304, max_length=16, num_layers=1, dim=1024, num_heads=16)
    assert set(float8_layers(llama, "tensorwise")) == {
        f"blocks.0.{layer}" for layer in ("attention.q", "attention.o", "mlp.gate", "mlp.up", "mlp.down")
    }
    assert set(float8_layers(gpt, "tensorwise")) == {"blocks.0.mlp.up"}
    assert set(float8_layers(llama, "rowwise")) == {"blocks.0.mlp.gate", "blocks.0.mlp.up"}
    assert set(float8_layers(gpt, "rowwise")) == set()
    assert len(float8_layers(llama, "tensorwise", small_layers=True)) == 7


def _quantized(tensor: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    """``tensor`` cast to ``dtype`` as float8 training casts it, and back: scaled so its largest magnitude (of all,
    or along ``dim`` of each row, the scale then rounded down to a power of two) lands on the format's largest
    value, rounded to the format, divided by the scale again."""
    largest = tensor.abs().amax() if dim is None else tensor.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / largest.double().clamp(min=1e-12)).float()
    if dim is not None:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (tensor.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() / scale


def test_the_emulated_float8_linear_is_the_hand_written_float8_matmuls():
    """Tensorwise: the output is the e4m3 input times the e4m3 weight; the input's gradient the e5m2 output
    gradient times the e4m3 weight; the weight's gradient the e5m2 output gradient times the e4m3 input (each tensor
    one scale). Rowwise: the output from per-row scales. All three differ from the unrounded matmuls by far more
    than the tolerance, so the comparison sees the rounding."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=generator, requires_grad=True)
    weight = torch.randn(32, 48, generator=generator)
    grad = torch.randn(64, 32, generator=generator)
    layers = {}
    for recipe in ("tensorwise", "rowwise"):
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        layer = torch.nn.Linear(48, 32, bias=False)
        layer.weight.data.copy_(weight)
        layers[recipe] = Float8Linear.from_float(layer, config=type(config)(**{**config.__dict__, "emulate": True}))
    out = layers["tensorwise"](x)
    out.backward(grad)
    expected_out = _quantized(x, E4M3) @ _quantized(weight, E4M3).T
    expected_grad_input = _quantized(grad, E5M2) @ _quantized(weight, E4M3)
    expected_grad_weight = _quantized(grad, E5M2).T @ _quantized(x, E4M3)
    for got, want, plain in [
        (out, expected_out, x @ weight.T),
        (x.grad, expected_grad_input, grad @ weight),
        (layers["tensorwise"].weight.grad, expected_grad_weight, grad.T @ x),
    ]:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got - plain).abs().max() > 100 * 1e-5
    rowwise = layers["rowwise"](x.detach())
    torch.testing.assert_close(rowwise, _quantized(x, E4M3, dim=-1) @ _quantized(weight, E4M3, dim=-1).T)


def test_a_plan_on_gpus_prices_float8_matmuls_at_the_float8_peak_and_gathers_their_weights_in_a_byte():
    """The tiny Llama under fsdp x 2 planned for H100s: each of its 14 block Linear layers runs three float8 matmuls a
    step (forward, input and weight gradients), priced at the FP8 peak (twice the bf16 one) at Float8's own
    efficiency; the output layer's stay bf16 matmuls. FSDP's all-gathers (forward, and again in backward) carry
    each converted weight in 1 byte, the rest in bfloat16's 2: the step's gathered bytes drop by those weights'
    elements, twice, over the 2 ranks."""
    plans = {
        flag: simulate_devices(resolved([*FLOAT8, "cluster=h100_sxm_8x", f"model.float8.enabled={flag}"]))[0][0]
        for flag in ("false", "true")
    }
    kernels = {flag: [(Kernel.parse(key), n) for key, n in plan.kernels.items()] for flag, plan in plans.items()}
    assert sum(count for kernel, count in kernels["true"] if kernel.kind == "float8_matmul") == 14 * 3
    assert not any(kernel.kind == "float8_matmul" for kernel, _ in kernels["false"])
    assert plans["true"].flops == plans["false"].flops
    job = resolved([*FLOAT8, "cluster=h100_sxm_8x"])
    kernel = next(kernel for kernel, _ in kernels["true"] if kernel.kind == "float8_matmul")
    as_bf16 = Kernel("matmul", kernel.flops, 0, kernel.tiles)
    efficiencies = job.cluster.matmul_efficiency / job.cluster.float8_matmul_efficiency
    assert kernel_seconds(Kernel("float8_matmul", kernel.flops, 0, kernel.tiles), job.cluster) == pytest.approx(
        kernel_seconds(as_bf16, job.cluster) * job.cluster.peak_tflops / job.cluster.float8_peak_tflops * efficiencies
    )
    gathered = {
        flag: sum(size for link, size in plan.collectives.items() if link.startswith("all_gather"))
        for flag, plan in plans.items()
    }
    net = job.meta_net()
    converted = sum(module.weight.numel() for module in float8_layers(net, "tensorwise", small_layers=True).values())
    assert gathered["false"] - gathered["true"] == 2 * converted  # (2 - 1) byte, gathered twice a step


def test_float8_split_by_tensor_parallelism_computes_one_devices_float8(tmp_path, home):
    """On 2 gloo ranks, a tiny Llama and an MLP in Float8 (both recipes, the small layers converted), split by tensor
    parallelism, against the same model whole on one device in torchao's Float8, one forward and backward pass each,
    five seeds (tests/helpers/float8_tensor_parallel.py). Twice: with sequence parallelism as this CPU lays the model
    out (torch's styles, each layer casting what it gathered), and as a GPU does (torchao's float8 styles, for the
    Llama's tensorwise layers alone: rowwise and biased layers keep torch's), without sequence parallelism, whose
    float8 gathers gloo cannot carry.

    Each cast's scale is the whole tensor's (a maximum over the ranks' shares), so the split computes the same casts
    and products, its sums in another order. An element that lands on a float8 rounding boundary can round the
    other way, a whole float8 step, and a gradient, passed back through later layers' casts, can carry that
    further; so the outputs within 1e-4 in every seed and every gradient within 1e-4 (norms) in the median seed:
    Float8 against the model unconverted is 1e-2 or more apart in both. Casts scaled by each rank's share alone fail
    the first (seen), and torchao's styles on the MLP's biased layers the second (their bias gradients from the
    float8 gradient: 2e-2 in every seed, seen)."""
    out = tmp_path / "differences.json"
    command = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = run_command(
        [sys.executable, *command, "tests/helpers/float8_tensor_parallel.py", str(out), "0,1,2,3,4"], home
    )
    assert result.returncode == 0, result.output[-3000:]
    cases: dict[str, list[dict]] = {}
    for name, case in json.loads(out.read_text()).items():
        cases.setdefault(name.rsplit(" ", 1)[0], []).append(case)
    assert set(cases) == {
        f"{family} {recipe} {layout}"
        for family in ("llama", "mlp")
        for recipe in ("tensorwise", "rowwise")
        for layout in ("sequence parallel", "float8 styles")
    }
    for name, seeds in cases.items():
        assert {seed["float8_layers"] for seed in seeds} == {14 if name.startswith("llama") else 3}, name
        styled = 14 if name == "llama tensorwise float8 styles" else 0
        assert {seed["float8_styles"] for seed in seeds} == {styled}, name
        for seed in seeds:
            assert seed["split"]["output"] < 1e-4 < 1e-2 < seed["plain"]["output"], (name, seed)
            assert min(seed["plain"]["gradients"].values()) > 1e-3, (name, seed)
        largest = sorted(max(seed["split"]["gradients"].values()) for seed in seeds)
        assert largest[len(largest) // 2] < 1e-4, (name, largest)


def test_a_tensor_parallel_plan_on_gpus_gathers_the_sequence_in_float8():
    """The tiny Llama (2 blocks) split over 2 tensor-parallel ranks, 16 x 16 tokens of width 32, planned for H100s in
    bf16-mixed and in Float8 (torchao's float8 styles, as a GPU run lays it out). Sequence parallelism all-gathers
    the whole sequence, 8,192 elements, from the ranks' shares: each block's attention and MLP input (4, forward)
    and the gradients of its two row-parallel outputs (4, backward), the final norm's output into the head (forward)
    and the gradient of the embedding's output (backward). In bf16-mixed the inputs are float32 (the residual
    stream and the norms' outputs, 4 bytes an element) and the blocks' gradients bf16 (2); in Float8 the blocks' 8
    gathers carry a byte an element, the head's and the embedding's as before. (A gather's bytes are its whole
    buffer, as the step-time model's ring reads them: seen failing when DTensor's gathers counted the share alone.)"""
    base = [*TINY_LLAMA_TP, "trainer.devices=2", "data.batch_size=16", "strategy=fsdp", "cluster=h100_sxm_8x"]
    base += ["strategy.tensor_parallel_size=2", "trainer.precision=bf16-mixed", "model.float8.small_layers=true"]
    plans = {
        flag: simulate_devices(resolved([*base, f"model.float8.enabled={flag}"]))[0][0] for flag in ("false", "true")
    }
    gather = "all_gather|tensor_parallel|2|1"
    assert {flag: plan.collective_calls[gather] for flag, plan in plans.items()} == {"false": 10, "true": 10}
    sequence = 16 * 16 * 32
    head_and_stem = sequence * (4 + 4)
    assert plans["false"].collectives[gather] == sequence * (4 * 4 + 4 * 2) + head_and_stem
    assert plans["true"].collectives[gather] == sequence * 8 + head_and_stem


# ---- the runs (tests/conftest.py: llama_float8_sweep): bf16 (job 0) and Float8 (job 1) under fsdp x 2 ----


def history(job_dir) -> list[dict]:
    return json.loads((job_dir / "result.json").read_text())["history"]


@pytest.mark.slow
def test_a_float8_run_trains_within_the_bound_of_the_bf16_run(llama_float8_sweep):
    """Every epoch's training and validation loss within ``LOSS_BOUND`` of the bf16 run's, and not equal to it:
    the run did train in float8."""
    bf16, fp8 = (history(job_dir) for job_dir in llama_float8_sweep)
    assert len(bf16) == len(fp8) == 3
    for plain, rounded in zip(bf16, fp8):
        for key in ("train/loss", "val/loss"):
            assert math.isclose(rounded[key], plain[key], rel_tol=LOSS_BOUND), (key, plain[key], rounded[key])
            assert rounded[key] != plain[key]


@pytest.mark.slow
def test_a_float8_run_resumes_exactly_and_exports_in_bfloat16(llama_float8_sweep, tmp_path, home):
    """Float8 for one epoch, then resumed from its checkpoint for two more: the resumed epochs are the straight
    run's to the last digit. Its checkpoint exports to a Hugging Face dir in bfloat16: each tensor the saved one
    rounded to bfloat16 (the weights were never float8 themselves)."""
    straight = llama_float8_sweep[1]
    job_dir = tmp_path / "resumed"
    args = [*FLOAT8, "model.float8.enabled=true", f"hydra.run.dir={job_dir}"]
    train([*args, "trainer.max_epochs=1"], home)
    train([*args, "ckpt_path=last"], home)
    resumed = history(job_dir)
    assert [epoch["epoch"] for epoch in resumed] == [0, 1, 2]
    for ours, theirs in zip(resumed[1:], history(straight)[1:]):
        assert {k: ours[k] for k in ("train/loss", "val/loss")} == {k: theirs[k] for k in ("train/loss", "val/loss")}
    out = tmp_path / "hf"
    result = run_command(
        [sys.executable, "-m", "project.cli.export", str(straight / "checkpoints" / "last.ckpt"), str(out),
         "--dtype", "bfloat16"], home)  # fmt: skip
    assert result.returncode == 0, result.output[-3000:]
    exported = load_file(out / "model.safetensors")
    saved = model_state(straight / "checkpoints" / "last.ckpt")
    assert {tensor.dtype for tensor in exported.values()} == {torch.bfloat16}
    q = saved["blocks.0.attention.q.weight"]
    assert q.dtype == torch.float32
    torch.testing.assert_close(exported["model.layers.0.self_attn.q_proj.weight"], q.to(torch.bfloat16), rtol=0, atol=0)


def test_float8_nets_materialise_with_their_seeded_weights():
    """Converting to Float8 keeps each weight's name, so a converted net materialises to the very weights of the
    plain one from the same seed (and a checkpoint or Hugging Face dir loads into it unchanged)."""
    nets = []
    for convert in (False, True):
        with torch.device("meta"):
            net = Llama(vocab_size=32, max_length=16, num_layers=2, dim=32, num_heads=2, num_kv_heads=1, hidden_dim=64)
        if convert:
            convert_to_float8(net, "tensorwise", emulate=True, gather_in_float8=False, small_layers=True)
        materialize(net, torch.device("cpu"), seed=3)
        nets.append(net.state_dict())
    assert nets[0].keys() == nets[1].keys()
    for name in nets[0]:
        assert torch.equal(nets[0][name], nets[1][name]), name
