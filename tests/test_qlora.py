"""QLoRA (``model.lora.quantize_base``, project/models/nf4.py): the NF4 base against the format's own error bound
and torchao's dequantization, its effect on the loss against a bound from the mean value theorem, its bytes in the
memory plan against arithmetic, and a run exported merged against transformers. (Per-epoch numbers of auto, ddp,
fsdp and pipeline against the hand-written loop on the dequantized base: test_reference.py.)"""

import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import QLORA, TINY_LLAMA_NF4, run_command, train
from hydra.utils import instantiate
from test_config import compose_train
from test_hf import transformers_val_loss
from test_memory_plan import resolved
from test_plan_search import SEARCH

from project.model_options import LoRAFineTuning
from project.models import Llama
from project.models.lora import LoRA, apply_lora
from project.models.nf4 import empty_nf4, is_nf4, quantizable_weights
from project.options.errors import ConfigError
from project.parallel.parallelize import materialize
from project.plan.memory_plan import plan_memory

pytestmark = pytest.mark.torch_internals

nf4_tensor = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
transformers = pytest.importorskip("transformers")

QUANTIZED = LoRA(rank=4, alpha=8.0, dropout=0.0, targets=("q", "v"), quantize_base=True)
# The 16 NF4 levels (the QLoRA paper's, Appendix E) and the widest gap between neighbours: a weight is stored as the
# level nearest to it over its block's absolute maximum, so that far off at most.
LEVELS = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461, 0.3379, 0.4407]
LEVELS += [0.5626, 0.7230, 1.0]
HALF_GAP = max(b - a for a, b in zip(LEVELS, LEVELS[1:])) / 2
PRESETS = ["gpt_125m", "gpt_1_3b", "llama_1b", "llama_8b", "llama_70b", "llama_405b", "mistral_7b", "qwen2_5_0_5b"]
PRESETS += ["qwen2_5_7b", "qwen3_0_6b", "qwen3_8b", "phi3_mini"]


def nf4_llama(lora: LoRA | None = QUANTIZED, seed: int = 0) -> Llama:
    """A Llama of the NF4-sized shape (conftest's TINY_LLAMA_NF4), with ``lora``, materialised from ``seed``."""
    with torch.device("meta"):
        shape = dict(dim=128, num_heads=2, num_kv_heads=1, head_dim=128, hidden_dim=256)
        net = Llama(vocab_size=32, max_length=16, num_layers=2, **shape)
    if lora is not None:
        apply_lora(net, lora)
    materialize(net, torch.device("cpu"), seed)
    return net


def test_the_nf4_base_is_torchaos_quantization_within_the_formats_error_bound():
    """Every frozen Linear weight of the blocks is stored in NF4 (the embedding, norms and output layer not), holds
    torchao's own quantization of the seeded weight, and dequantizes to within the bound the format gives: for a
    weight in a block of maximum ``a``, ``a`` times half the widest gap between levels, plus the error of ``a``
    itself, quantized to 8 bits (256 steps over twice the largest distance of a maximum from their mean)."""
    net, plain = nf4_llama(), nf4_llama(lora=None)
    quantized = dict(net.named_parameters())
    names = [f"{name}.weight" for name in quantizable_weights(net)]
    assert len(names) == 2 * 7 and all(is_nf4(quantized[name]) for name in names)  # q k v o gate up down, 2 blocks
    assert sum(is_nf4(parameter) for parameter in net.parameters()) == len(names)
    for name, weight in plain.named_parameters():
        if name not in names:
            continue
        stored = quantized[name].get_original_weight()
        assert torch.equal(stored, nf4_tensor.to_nf4(weight.detach(), 64, 256).get_original_weight())
        blocks = weight.detach().reshape(-1, 64)
        maxima = blocks.abs().amax(dim=1)
        centred = (maxima - maxima.mean()).reshape(-1, 256)
        maxima_error = centred.abs().amax(dim=1, keepdim=True).expand(-1, 256).reshape(-1) / 128
        bound = (maxima * HALF_GAP + maxima_error)[:, None]
        error = (stored.reshape(-1, 64) - blocks).abs()
        assert (error <= bound * (1 + 1e-5)).all(), name
        assert error.mean() > 0.01 * blocks.abs().mean()  # 4 bits: not a lossless copy


def test_an_empty_meta_nf4_tensor_has_the_parts_to_nf4_makes():
    """The meta base is built without quantizing (``empty_nf4``): its parts have the shapes, dtypes and settings of
    torchao's own ``to_nf4`` on the same meta weight."""
    weight = torch.empty(384, 128, device="meta")
    made, expected = empty_nf4(weight), nf4_tensor.to_nf4(weight, 64, 256)
    names, settings = expected.__tensor_flatten__()
    for name in names:
        ours, theirs = getattr(made, name), getattr(expected, name)
        assert (ours.shape, ours.dtype, ours.device) == (theirs.shape, theirs.dtype, theirs.device), name
    assert made.__tensor_flatten__()[1] == settings and (made.shape, made.dtype) == (weight.shape, weight.dtype)


def test_the_nf4_bases_loss_is_within_the_mean_value_bounds_of_the_full_precision_loss():
    """At the start (LoRA's B = 0, so the adapters add nothing) the loss of the NF4 base against the full-precision
    one on a batch of tokens. With dW the quantization error (the stored weights' own), the mean value theorem gives
    L(W + dW) - L(W) = d(t) for some t in [0, 1], where d(t) = <grad L(W + t dW), dW> is the loss's derivative along
    dW: the change lies between the least and the largest d on the segment, here measured at 11 points of it (with
    a margin of a tenth of the largest |d| for the points between). Computed in the model with its NF4 weights on
    one side, in plain float32 with autograd on the other."""
    plain, net = nf4_llama(lora=None), nf4_llama()
    tokens = torch.randint(0, 32, (8, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss(model: torch.nn.Module) -> torch.Tensor:
        return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())

    names = [f"{name}.weight" for name in quantizable_weights(net)]
    full = dict(plain.named_parameters())
    deltas = {name: dict(net.named_parameters())[name].get_original_weight() - full[name].detach() for name in names}
    with torch.no_grad():
        change = (loss(net) - loss(plain)).item()
    derivatives = []
    for t in torch.linspace(0, 1, 11):
        between = nf4_llama(lora=None)
        with torch.no_grad():
            for name, parameter in between.named_parameters():
                if name in deltas:
                    parameter.copy_(full[name] + t * deltas[name])
        grads = torch.autograd.grad(loss(between), [dict(between.named_parameters())[name] for name in names])
        derivatives.append(sum((grad * deltas[name]).sum() for grad, name in zip(grads, names)).item())
    print(f"loss change {change:.2e}; derivative along dW from {min(derivatives):.2e} to {max(derivatives):.2e}")
    margin = 0.1 * max(abs(d) for d in derivatives)
    assert min(derivatives) - margin <= change <= max(derivatives) + margin, (change, derivatives)
    assert abs(change) > 1e-4  # 4 bits move the loss: the check is not of two equal models


def nf4_bytes(weights: int, shards: int) -> int:
    """What a rank holds of an NF4 weight of ``weights`` values split over ``shards`` ranks (1: whole): half a byte
    a value, an int8 maximum per 64 values, a float32 factor per 256 maxima; and whole on every rank, the float32
    mean of the maxima and the 16 float32 levels."""
    return (weights // 2 + weights // 64 + 4 * (weights // (64 * 256))) // shards + 4 + 16 * 4


def test_an_fsdp_plan_holds_the_nf4_base_in_4_bits_sharded_and_the_rest_as_arithmetic_says():
    """The QLoRA Llama (fsdp over 2 ranks) is planned with the bytes of its NF4 weights as the format stores them:
    the weights that split into whole blocks of maxima sharded, k and v (128 x 128: one block of maxima) whole on
    each rank; the float32 embedding, norms, output layer and adapters sharded by rows; gradients and AdamW's state
    for the adapters alone."""
    job = resolved([*TINY_LLAMA_NF4, "data.batch_size=16", QLORA, "strategy=fsdp", "trainer.devices=2"])
    (rank,) = plan_memory(job).devices
    net = nf4_llama(LoRA(rank=4, alpha=8.0, dropout=0.0, targets=("q", "v", "up"), quantize_base=True))
    quantized = [module.weight for module in quantizable_weights(net).values()]
    whole = [weight for weight in quantized if weight.numel() == 128 * 128]
    assert len(whole) == 4  # k and v of each block
    others = [p for p in net.parameters() if not is_nf4(p)]
    trained = [p for p in net.parameters() if p.requires_grad]
    sharded_others = sum(math.ceil(p.shape[0] / 2) * p[0].numel() * 4 for p in others)
    expected = sum(nf4_bytes(w.numel(), 1 if w.numel() == 128 * 128 else 2) for w in quantized) + sharded_others
    assert rank.params == expected
    adapters = sum(math.ceil(p.shape[0] / 2) * p[0].numel() * 4 for p in trained)
    assert rank.grads == adapters and rank.optimizer == 2 * adapters + 4 * len(trained)


@pytest.mark.slow
def test_a_qlora_run_reading_a_hugging_face_dir_under_fsdp_exports_merged_to_its_val_loss(tmp_path, home):
    """A transformers Llama of NF4-sized weights, fine-tuned here with QLoRA under fsdp x 2 (each rank quantizes the
    weights it reads whole, then keeps its rows), then `python -m project.cli.export`: transformers computes the
    run's last val/loss from the merged dir (the dequantized base plus the adapters), and not from the base dir."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    job = tmp_path / "run"
    overrides = [
        *(item for item in TINY_LLAMA_NF4 if not item.startswith("model.net.")),
        f"model.init_from={tmp_path / 'hf'}",
        QLORA,
        "strategy=fsdp",
        "trainer.devices=2",
        "data.batch_size=16",
        "trainer.max_epochs=2",
        "model.optimizer.lr=0.01",
    ]
    train([*overrides, f"hydra.run.dir={job}"], home)
    run_loss = json.loads((job / "result.json").read_text())["final"]["val/loss"]
    result = run_command(
        [sys.executable, "-m", "project.cli.export", str(job / "checkpoints" / "last.ckpt"), str(tmp_path / "merged")],
        home,
    )
    assert result.returncode == 0, result.output
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert transformers_val_loss(merged, overrides) == pytest.approx(run_loss, rel=1e-5)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert transformers_val_loss(base, overrides) != pytest.approx(run_loss, rel=1e-3)


def test_a_weight_nf4_cannot_store_is_refused_by_name():
    with torch.device("meta"):
        net = Llama(vocab_size=32, max_length=16, num_layers=1, dim=64, num_heads=2, num_kv_heads=1, hidden_dim=128)
    refusal = r"model.lora.quantize_base: stores blocks.0.attention.q.weight \(\(64, 64\)\)"
    with pytest.raises(ConfigError, match=refusal):
        apply_lora(net, QUANTIZED)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_can_store_its_base_in_nf4(preset):
    """The presets of released models' sizes (composed as a user composes them, on the meta device) have every Linear
    weight of their blocks a multiple of NF4's 16384-weight quantum: QLoRA stores each of them in NF4."""
    cfg = compose_train([f"model={preset}", "data=tokens", QLORA.replace("[q,v,up]", "[q]")])
    with torch.device("meta"):
        module = instantiate(cfg.model, net=instantiate(cfg.model.net))
    quantized = [p for p in module.net.parameters() if is_nf4(p)]
    linear_per_block = 6 if preset.startswith("gpt") else 7  # q, k, v, proj, up, down; or q, k, v, o, gate, up, down
    (lora,) = [option for option in module.options if isinstance(option, LoRAFineTuning)]
    assert lora.quantize_base and len(quantized) == linear_per_block * cfg.model.net.num_layers


@pytest.mark.slow
def test_plan_search_with_qlora_ranks_every_layout_but_the_tensor_parallel_ones(tmp_path, home):
    """plan=search over 2 GPUs for an NF4-sized GPT with QLoRA: data parallel, FSDP and the pipeline, each with every
    checkpointing mode, ranked with the NF4 base's bytes; the layouts over tensor-parallel ranks, which would split
    the base by columns, are left out by the run's own check."""
    search = [arg for arg in SEARCH if not arg.startswith("model.net.")]
    shape = ["model.net.num_layers=3", "model.net.dim=128", "model.net.num_heads=2"]
    output = train(["plan=search", *search, *shape, QLORA, f"paths.cache_dir={tmp_path}"], home).output
    assert "(9 layouts," in output and "tensor_parallel_size" not in output
    assert "Fastest that fits in 80.00 GiB: strategy=" in output
