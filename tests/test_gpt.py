"""model=gpt with token data: size presets, the known entropy floor, LM metrics, activation checkpointing.

Every strategy against the hand-written loop: test_reference.py."""

import math

import pytest
import torch
from conftest import only_run
from hydra.utils import instantiate
from test_config import compose_train
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from project.accounting.memory_trackers import held_bytes
from project.data.tokens import MarkovTokenDataModule, TextDataModule, entropy_rate, random_markov_chain
from project.models import GPT, Llama
from project.models.gpt import MLP
from project.parallel.parallelize import _selective_contexts, apply_activation_checkpointing
from project.tasks.language_model import TokenCrossEntropy

pytestmark = pytest.mark.torch_internals

LM_KEYS = ["train/loss", "val/loss", "val/perplexity"]


@pytest.mark.parametrize("preset,expected_millions", [("gpt_125m", 124.4), ("gpt_350m", 354.8), ("gpt_1_3b", 1313.6)])
def test_size_presets_on_the_meta_device(preset, expected_millions):
    """GPT-2's vocabulary and context; built on the meta device, so nothing is allocated."""
    cfg = compose_train([f"model={preset}", "data=tokens", "data.vocab_size=50257", "data.seq_length=1024"])
    with torch.device("meta"):
        net = instantiate(cfg.model.net)
    count = sum(p.numel() for p in net.parameters())  # a tied weight counts once
    print(f"{preset}: {count / 1e6:.1f} M parameters")
    assert count / 1e6 == pytest.approx(expected_millions, rel=0.01)
    assert {block.mlp.gelu_approximate for block in net.blocks} == {"tanh"}  # GPT-2's GELU


def test_the_mlp_gelu_is_exact_or_gpt2s_tanh_approximation():
    """The MLP against GELU written out: x * Phi(x) with the normal CDF through erf, and GPT-2's
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). The two differ by up to about 1e-3 on these inputs."""
    torch.manual_seed(0)
    x = 3 * torch.randn(4, 5, 16, dtype=torch.float64)
    weights = MLP(16, dropout=0.0).double().state_dict()  # the same weights for both variants
    outputs = {}
    for variant, gelu in (
        ("none", lambda h: 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))),
        ("tanh", lambda h: 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))),
    ):
        mlp = MLP(16, dropout=0.0, gelu_approximate=variant).double()
        mlp.load_state_dict(weights)
        expected = mlp.down(gelu(mlp.up(x)))
        outputs[variant] = mlp(x)
        torch.testing.assert_close(outputs[variant], expected, rtol=1e-12, atol=1e-12)
    assert (outputs["none"] - outputs["tanh"]).abs().max() > 1e-5


def test_entropy_rate_of_a_known_chain():
    # Two states that swap with probability p: stationary (1/2, 1/2), entropy rate h(p).
    p = 0.2
    transitions = torch.tensor([[1 - p, p], [p, 1 - p]])
    assert entropy_rate(transitions) == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)), rel=1e-6)
    chain = random_markov_chain(16, 3, torch.Generator().manual_seed(0))
    assert torch.allclose(chain.sum(dim=1), torch.ones(16)) and ((chain > 0).sum(dim=1) == 3).all()
    assert 0 < entropy_rate(chain) < math.log(3)


def test_markov_data_matches_its_floor():
    """The empirical loss of the true transition probabilities on the sampled data is the entropy floor."""
    dm = MarkovTokenDataModule(
        vocab_size=32, branching=4, seq_length=64, num_train=2000, num_val=10, batch_size=8, seed=3
    )
    dm.setup("fit")
    inputs, targets = dm.train_set.tensors
    empirical = -torch.log(dm.transitions[inputs, targets]).mean().item()
    assert empirical == pytest.approx(dm.entropy_floor, rel=0.02)
    again = MarkovTokenDataModule(32, 4, 64, 2000, 10, 8, seed=3)
    again.setup("fit")
    assert torch.equal(again.train_set.tensors[0], inputs)  # deterministic from the seed


def test_text_data_is_bytes_split_without_overlap(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 8)  # 2048 bytes
    dm = TextDataModule(str(text), seq_length=16, val_fraction=0.25, batch_size=4, seed=0)
    assert (dm.num_train_samples, dm.num_val_samples) == (95, 31)  # known before setup, for the checks
    dm.setup("fit")
    inputs, targets = dm.train_set.tensors
    assert len(inputs) == 95 and inputs.shape[1] == 16 and int(inputs.max()) <= 255
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next bytes
    assert int(dm.val_set.tensors[0][0, 0]) == 1536 % 256  # the split starts at the last quarter


@pytest.mark.parametrize(
    "build",
    [
        lambda: GPT(vocab_size=64, max_length=32, num_layers=4, dim=64, num_heads=4),
        lambda: Llama(vocab_size=64, max_length=32, num_layers=4, dim=64, num_heads=4, num_kv_heads=2, hidden_dim=128),
    ],
    ids=["gpt", "llama"],
)
def test_activation_checkpointing_same_loss_less_memory_held_for_backward(build):
    """Full and selective checkpointing give the loss and gradients of none, bit for bit. What the forward leaves
    held for backward (torch's MemTracker, the model's own tensors counted alike in each): under full less than
    half of none's, under selective (the matmuls' outputs but every second, attention's) between the two."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 32))
    losses, held, grads = [], [], []
    for mode in ("off", "selective", "full"):
        torch.manual_seed(0)
        model = build()
        apply_activation_checkpointing(model, mode)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            before = held_bytes(tracker)
            loss = TokenCrossEntropy()(model(tokens[:, :-1]), tokens[:, 1:])
            held.append(held_bytes(tracker) - before)
            loss.backward()
        losses.append(loss.item())
        grads.append([parameter.grad for parameter in model.parameters()])
    assert losses[0] == losses[1] == losses[2]
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))
    none, selective, full = held
    assert full < 0.5 * none and full < selective < none, held


def test_selective_checkpointing_compiles_with_eager_gradients():
    """Selective checkpointing under compile's tracing (AOTAutograd, the ``aot_eager`` backend: inductor's input
    without its kernels) gives eager's loss and gradients. Its contexts are torch's two dispatch modes, which compile
    requires of them (torch 2.11 checks it while AOTAutograd traces): only a simulation's recompute is marked."""
    forward, recompute = _selective_contexts()
    assert isinstance(forward, TorchDispatchMode) and isinstance(recompute, TorchDispatchMode)
    tokens = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Llama(vocab_size=64, max_length=32, num_layers=2, dim=64, num_heads=4, num_kv_heads=2, hidden_dim=128)
        apply_activation_checkpointing(model, "selective")
        if compiled:
            for block in model.blocks:
                block.forward = torch.compile(block.forward, backend="aot_eager")
        loss = TokenCrossEntropy()(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), [parameter.grad for parameter in model.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(compiled_grad, eager_grad)


@pytest.mark.slow
def test_gpt_logs_language_model_metrics(gpt_auto):
    run = only_run(gpt_auto)
    assert run.name == "gpt-auto-1dev-1node"
    for key in [*LM_KEYS, "perf/tokens_per_sec", "memory/model_state_mb", "data/entropy_floor"]:
        assert len(run.series(key)) == 3, key
    for loss, perplexity in zip(run.series("val/loss"), run.series("val/perplexity")):
        assert perplexity == pytest.approx(math.exp(loss), rel=1e-4)
    assert run.summary["val/loss"] == run.series("val/loss")[-1]
    assert run.summary["best/val/loss"] == min(run.series("val/loss"))  # the GPT's best_metric: val/loss, min
    floor = run.series("data/entropy_floor")[0]
    assert floor < run.series("val/loss")[-1] < run.series("val/loss")[0]
