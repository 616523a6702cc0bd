"""The mixture of experts (``model=moe``, project/models/moe.py): its routing and dispatch against a per-token loop
written from the definition, its forward against transformers' Qwen 3 MoE and Mixtral both ways, its presets'
parameter counts against transformers' own classes, and a Hugging Face dir evaluated under fsdp. (Per-epoch numbers
of auto, ddp, fsdp and pipeline against the hand-written loop: test_reference.py.)"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import train
from hydra.utils import instantiate
from test_config import compose_train
from test_hf import LLAMA, transformers_val_loss
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from project.checkpointing.hf import HFWeights, check_matches, net_options, read_config, write_hf_dir
from project.models import MoE
from project.models.lora import LoRA, apply_lora
from project.models.moe import ExpertMLPs, Experts, auxiliary_loss, mixtures, swiglu_experts
from project.options.errors import ConfigError
from project.parallel.fake_process_group import fake_process_group
from project.parallel.parallelize import apply_activation_checkpointing, apply_fsdp, materialize

pytestmark = pytest.mark.torch_internals

transformers = pytest.importorskip("transformers")


def per_token(experts: Experts, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """The mixture's output written from its definition, token by token: the router's scores (softmax over the
    experts, or a sigmoid each), the top k, their weights (renormalised if asked), each chosen expert's SwiGLU
    output weighted and summed, plus the shared expert. With ``capacity``, an expert serves only its first
    ``capacity`` assignments in token order."""
    logits = x.float() @ experts.router.weight.float().T
    scores = logits.softmax(-1) if experts.router_scores == "softmax" else logits.sigmoid()
    served = [0] * experts.num_experts
    out = []
    for token in range(x.shape[0]):
        top = sorted(range(experts.num_experts), key=lambda e: -scores[token, e].item())[: experts.experts_per_token]
        weights = scores[token, top]
        if experts.normalize_weights:
            weights = weights / weights.sum()
        y = torch.zeros(x.shape[1])
        for expert, weight in zip(top, weights):
            served[expert] += 1
            if capacity is not None and served[expert] > capacity:
                continue
            mlps = experts.experts
            hidden = F.silu(mlps.gate[expert] @ x[token]) * (mlps.up[expert] @ x[token])
            y = y + weight * (mlps.down[expert] @ hidden)
        if experts.shared is not None:
            y = y + experts.shared(x[token])
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize(
    "router_scores, normalize, capacity_factor, shared",
    [("softmax", True, None, None), ("sigmoid", False, None, 16), ("softmax", True, 0.75, None)],
    ids=["qwen3-mixtral", "sigmoid-shared", "capped"],
)
def test_the_mixture_computes_its_definition_token_by_token(router_scores, normalize, capacity_factor, shared):
    """Outputs and gradients of a mixture of 6 experts, 2 per token, against ``per_token`` on 40 tokens; capped, an
    expert serves at most ceil(0.75 x 40 x 2 / 6) = 10 assignments in training, and every one in evaluation."""
    torch.manual_seed(0)
    experts = Experts(24, 20, 6, 2, router_scores, normalize, capacity_factor, shared)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.normal_(0, 0.3)
    x = torch.randn(40, 24, requires_grad=True)
    capacity = math.ceil(capacity_factor * 40 * 2 / 6) if capacity_factor else None
    ours, theirs = experts(x), per_token(experts, x, capacity)
    assert torch.allclose(ours, theirs, atol=1e-5)
    (grad_ours,) = torch.autograd.grad(ours.square().sum(), x)
    (grad_theirs,) = torch.autograd.grad(theirs.square().sum(), x)
    assert torch.allclose(grad_ours, grad_theirs, atol=1e-4)
    if capacity is not None:
        assert not torch.allclose(ours, per_token(experts, x), atol=1e-3)  # some assignments were dropped
        experts.eval()
        assert torch.allclose(experts(x), per_token(experts, x), atol=1e-5)  # none in evaluation


FAMILIES = {
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(num_experts=4, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16),
    ),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(num_local_experts=4)),
}
# test_hf's tiny Llama shape (its own RoPE and norm epsilon left to each family's defaults), 2 experts per token.
SHAPE = {key: value for key, value in LLAMA.items() if key not in ("rope_parameters", "rms_norm_eps")}
SHAPE["num_experts_per_tok"] = 2


def random_family_dir(family: str, path) -> torch.nn.Module:
    """A transformers model of ``family``, its every weight drawn (norms and router included), saved at ``path``."""
    config_class, model_class, options = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config_class(**SHAPE, **options)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.2)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hugging_face_mixture_computes_its_logits_in_and_out(family, tmp_path):
    """A random Qwen 3 MoE or Mixtral dir read here (its shape from config.json, each expert's tensors stacked)
    gives transformers' logits to 1e-5; written back out, transformers loads it as the same family and gives them
    again."""
    reference = random_family_dir(family, tmp_path / "hf")
    options = net_options(read_config(tmp_path / "hf"))
    with torch.device("meta"):
        net = MoE(**options)
    materialize(net, torch.device("cpu"), 0, HFWeights(tmp_path / "hf"))
    tokens = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
        assert torch.allclose(net.eval()(tokens), expected, atol=1e-5)
        write_hf_dir(net.state_dict(), net, options, tmp_path / "out")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        assert type(back) is type(reference) and torch.allclose(back(tokens).logits, expected, atol=1e-5)


def test_a_mixtral_dir_under_the_qwen3_moe_group_is_sent_to_the_mixtral_preset(tmp_path):
    """model=moe is Qwen 3 MoE's (its per-head norms); a Mixtral dir loaded with it is refused, naming the preset
    that loads it, which then does."""
    random_family_dir("mixtral", tmp_path / "hf")
    for preset, refused in (("moe", True), ("mixtral_8x7b", False)):
        cfg = compose_train([f"model={preset}", "data=tokens", f"model.init_from={tmp_path / 'hf'}"])
        net_cfg = {**cfg.model.net, **net_options(read_config(tmp_path / "hf"))}
        with torch.device("meta"):
            net = instantiate(net_cfg)
        if refused:
            with pytest.raises(ConfigError, match="use model=mixtral_8x7b"):
                check_matches(tmp_path / "hf", net, dict(cfg.model.net))
        else:
            check_matches(tmp_path / "hf", net, net_cfg)


@pytest.mark.parametrize(
    "preset, config",
    [
        (
            "qwen3_30b_a3b",
            transformers.Qwen3MoeConfig(
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=6144,
                num_hidden_layers=48,
                num_attention_heads=32,
                num_key_value_heads=4,
                head_dim=128,
                num_experts=128,
                num_experts_per_tok=8,
                moe_intermediate_size=768,
                tie_word_embeddings=False,
            ),
        ),
        (
            "mixtral_8x7b",
            transformers.MixtralConfig(
                vocab_size=32000,
                hidden_size=4096,
                intermediate_size=14336,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=8,
                num_local_experts=8,
                num_experts_per_tok=2,
            ),
        ),
    ],
)
def test_a_presets_parameter_count_is_transformers_count(preset, config):
    """Composed as a user composes it, on the meta device: as many parameters as transformers' own class of the
    published config (Qwen3-30B-A3B: 30,532,122,624; Mixtral-8x7B: 46,702,792,704)."""
    cfg = compose_train([f"model={preset}", "data=tokens", f"data.vocab_size={config.vocab_size}"])
    with torch.device("meta"):
        ours = sum(p.numel() for p in instantiate(cfg.model.net).parameters())
        theirs = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    assert ours == theirs


@pytest.mark.slow
def test_a_hugging_face_mixture_evaluates_to_its_transformers_loss_under_fsdp(tmp_path, home):
    """mode=eval model=moe model.init_from=<a Qwen 3 MoE dir> under fsdp x 2: the shape comes from its config.json
    (a capacity factor given beside it is the run's own, not the dir's), each rank reads its shard of the stacked
    experts (rows of whole experts), and the run's val/loss is transformers' on the same tokens."""
    reference = random_family_dir("qwen3_moe", tmp_path / "hf")
    overrides = [
        "model=moe",
        "data=tokens",
        "data.vocab_size=61",
        "data.seq_length=16",
        "data.num_train=64",
        "data.num_val=40",
        "data.batch_size=8",
        f"model.init_from={tmp_path / 'hf'}",
        "model.net.capacity_factor=1.25",  # drops in training only: the dir's model still, in evaluation
        "mode=eval",
        "strategy=fsdp",
        "trainer.devices=2",
        "print_config=false",
    ]
    train([*overrides, f"hydra.run.dir={tmp_path / 'run'}"], home)
    run_loss = json.loads((tmp_path / "run" / "result.json").read_text())["final"]["val/loss"]
    assert transformers_val_loss(reference, overrides) == pytest.approx(run_loss, rel=1e-5)


class OpsSeen(TorchDispatchMode):
    """The aten ops run while active (their overload packets)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._overloadpacket)
        return func(*args, **(kwargs or {}))


def test_in_bfloat16_the_experts_run_as_grouped_matmuls_equal_to_a_loop():
    """Under bf16 autocast the experts are three ``_grouped_mm`` calls, no plain matmul, whose outputs and
    gradients (rows and stacked weights) equal a loop over the experts' ``F.linear`` under the same autocast; an
    expert with no rows included. In float32 they run as that loop."""
    torch.manual_seed(0)
    mlps = ExpertMLPs(4, 24, 16)
    with torch.no_grad():
        for parameter in mlps.parameters():
            parameter.normal_(0, 0.3)
    rows, counts = torch.randn(30, 24), [12, 0, 11, 7]

    def loop(rows, gate, up, down):
        parts = zip(rows.split(counts), gate.unbind(0), up.unbind(0), down.unbind(0), strict=True)
        return torch.cat([F.linear(F.silu(F.linear(p, g)) * F.linear(p, u), d) for p, g, u, d in parts])

    weights = list(mlps.parameters())
    cotangent = torch.randn(30, 24)
    results = {}
    for name in ("grouped", "loop"):
        leaves = [tensor.detach().clone().requires_grad_() for tensor in (rows, *weights)]
        with torch.autocast("cpu", dtype=torch.bfloat16), OpsSeen() as seen:
            out = swiglu_experts(leaves[0], counts, *leaves[1:]) if name == "grouped" else loop(*leaves)
            (out.float() * cotangent).sum().backward()
        results[name] = (out, [leaf.grad for leaf in leaves], seen.ops)
    (out, grads, ops), (out_loop, grads_loop, _) = results["grouped"], results["loop"]
    assert torch.ops.aten._grouped_mm in ops and not ops & {torch.ops.aten.mm, torch.ops.aten.addmm}
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), out_loop.float(), rtol=1e-2, atol=1e-2)
    for grad, grad_loop in zip(grads, grads_loop, strict=True):
        assert torch.allclose(grad, grad_loop, rtol=2e-2, atol=2e-2)
    assert grads[2][1].abs().sum() == 0  # expert 1 had no rows
    with OpsSeen() as seen:
        mlps(rows, counts)
    assert torch.ops.aten._grouped_mm not in seen.ops


def tiny_mixture(**options) -> MoE:
    """3 blocks, the first dense, 6 experts of which 2 a token, weights drawn with std 0.3 (routing far from even)."""
    torch.manual_seed(0)
    net = MoE(vocab_size=32, max_length=16, num_layers=3, dim=24, num_heads=2, num_kv_heads=1, hidden_dim=32,
              num_experts=6, experts_per_token=2, expert_hidden_dim=20, first_dense_layers=1, **options)  # fmt: skip
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.normal_(0, 0.3)
    return net


def router_logits(net: MoE) -> list[torch.Tensor]:
    """The routers' logits of ``net``'s forwards, appended as they run (forward hooks)."""
    logits: list[torch.Tensor] = []
    for block in net.blocks[1:]:
        block.mlp.router.register_forward_hook(lambda module, inputs, output: logits.append(output))
    return logits


def test_the_balance_loss_is_transformers_and_enters_the_training_loss_weighted():
    """Each mixture's balance loss equals transformers' ``load_balancing_loss_func`` of its router's logits, and
    ``auxiliary_loss`` is the weight times their mean, with its gradient reaching the routers as that of
    transformers' losses does."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    net = tiny_mixture(load_balancing_weight=0.1)
    logits = router_logits(net)
    net(torch.randint(0, 32, (4, 16)))
    ours = auxiliary_loss(net)
    theirs = 0.1 * torch.stack([load_balancing_loss_func((layer.float(),), 6, 2) for layer in logits]).mean()
    assert torch.allclose(ours, theirs, rtol=1e-6)
    assert ours > 0.1 * 2  # routing this uneven costs more than an even one's 2 (experts_per_token)
    routers = [block.mlp.router.weight for block in net.blocks[1:]]
    grads = torch.autograd.grad(ours, routers, retain_graph=True)  # the graph both losses share, up to the logits
    for grad, expected in zip(grads, torch.autograd.grad(theirs, routers), strict=True):
        assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-8)
    assert auxiliary_loss(tiny_mixture()) is None  # weight 0: nothing added


def test_the_tally_counts_the_routers_choices_once_also_when_recomputed():
    """Each mixture's tally: each expert's assignments (a hand count of the top 2 of its router's logits), the
    ones a capacity dropped, over two training forwards; a checkpointed block's recompute in backward adds none."""
    net = tiny_mixture(capacity_factor=0.5)
    apply_activation_checkpointing(net, "full")
    logits = router_logits(net)
    for _ in range(2):
        net(torch.randint(0, 32, (4, 16))).square().mean().backward()
    forwards = logits[:2] + logits[4:6]  # each forward's two mixtures, then their recompute in backward
    for layer, mixture in mixtures(net).items():
        tally = mixture.take_tally()
        chosen = [step[layer - 1].softmax(-1).topk(2).indices.flatten() for step in (forwards[:2], forwards[2:])]
        counts = [torch.bincount(step, minlength=6) for step in chosen]
        capacity = math.ceil(0.5 * 64 * 2 / 6)
        assert tally.forwards == 2 and torch.equal(tally.load, sum(counts))
        assert tally.dropped == sum(int((count - capacity).clamp(min=0).sum()) for count in counts) > 0
        assert mixture.take_tally() is None  # taken
    net.eval()
    net(torch.randint(0, 32, (4, 16)))
    assert all(mixture.tally is None for mixture in mixtures(net).values())  # evaluation tallies nothing


def test_a_plan_of_a_mixture_routes_evenly_on_fake_tensors():
    """On tensors without values (the memory plan's fake tensors, the meta device) the experts take the batch's
    assignments evenly: 40 tokens x 2 of 6 experts is 14, 14, 13, 13, 13, 13 rows."""
    experts = Experts(24, 20, 6, 2, "softmax", True, None, None)
    counts = torch.empty(6, dtype=torch.long, device="meta")
    assert experts.taken(counts, 40) == [14, 14, 13, 13, 13, 13]
    with torch.device("meta"):
        net = MoE(vocab_size=32, max_length=8, num_layers=1, dim=24, num_heads=2, num_kv_heads=1, hidden_dim=32,
                  num_experts=6, experts_per_token=2, expert_hidden_dim=20)  # fmt: skip
        assert net(torch.zeros(2, 8, dtype=torch.long)).shape == (2, 8, 32)


def test_each_fsdp_rank_reads_its_experts_even_with_fewer_experts_than_ranks(tmp_path):
    """A Qwen 3 MoE dir of 4 experts read under FSDP over 8 ranks (torch's fake process group, one rank after
    another): each rank's piece of every parameter is its shard of the whole model's, the ranks past the last
    expert holding none of the stacked experts."""
    random_family_dir("qwen3_moe", tmp_path / "hf")
    weights, options = HFWeights(tmp_path / "hf"), net_options(read_config(tmp_path / "hf"))
    with torch.device("meta"):
        whole = MoE(**options)
    materialize(whole, torch.device("cpu"), 0, weights)
    for rank in range(8):
        with fake_process_group(8, rank):
            with torch.device("meta"):
                net = MoE(**options)
            apply_fsdp(net, init_device_mesh("cpu", (8,)))
            materialize(net, torch.device("cpu"), 0, weights)
            for name, parameter in net.named_parameters():
                expected = distribute_tensor(
                    whole.get_parameter(name).detach(), parameter.device_mesh, parameter.placements, src_data_rank=None
                ).to_local()
                assert torch.equal(parameter.to_local(), expected), (rank, name)
            assert net.blocks[0].mlp.experts.gate.to_local().shape[0] == (1 if rank < 4 else 0)


def test_lora_on_a_mixture_adapts_its_linear_layers_and_not_the_stacked_experts():
    """Targets are the Linear layers of any block: a dense first block's MLP, the router and the shared expert. The
    routed experts (stacked tensors, not Linear layers) stay frozen with the rest."""
    with torch.device("meta"):
        net = MoE(vocab_size=32, max_length=8, num_layers=2, dim=24, num_heads=2, num_kv_heads=1, hidden_dim=32,
                  num_experts=4, experts_per_token=2, expert_hidden_dim=20, first_dense_layers=1,
                  shared_expert_hidden_dim=16)  # fmt: skip
    adapted = apply_lora(net, LoRA(rank=2, alpha=4.0, dropout=0.0, targets=("q", "router", "gate")))
    assert adapted == [
        "blocks.0.attention.q",
        "blocks.0.mlp.gate",
        "blocks.1.attention.q",
        "blocks.1.mlp.router",
        "blocks.1.mlp.shared.gate",
    ]
    assert not any(parameter.requires_grad for parameter in net.blocks[1].mlp.experts.parameters())
