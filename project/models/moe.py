"""A mixture-of-experts decoder (Mixtral, Qwen 3 MoE, DeepSeek-V3's shape): Llama's blocks (``project.models.llama``)
whose MLP is, from ``first_dense_layers`` on, a router and ``num_experts`` SwiGLU experts, of which each token goes
through ``experts_per_token``; with ``shared_expert_hidden_dim``, also through one shared SwiGLU expert.

Routing (``Experts.route``): the router's scores are a softmax over the experts (Mixtral, Qwen 3) or a sigmoid of
each (DeepSeek-V3); a token goes to the ``experts_per_token`` of highest score, and their outputs are summed weighted
by those scores, renormalised to sum to 1 with ``normalize_weights`` (Mixtral always, Qwen 3's ``norm_topk_prob``).

Dispatch (``Experts.forward``): the token-expert assignments are sorted by expert, token order kept within each, and
each expert runs once on its own rows. Without a ``capacity_factor`` no assignment is dropped (as transformers'
models compute). With one, an expert takes at most ``ceil(capacity_factor x tokens x experts_per_token /
num_experts)`` assignments of a training batch, the first in token order; an assignment beyond it adds nothing,
and its token goes on through its other experts and the residual stream. Evaluation drops none, so that its outputs
do not depend on the batch size.

The experts' weights are stacked, one tensor per projection over all experts (``ExpertMLPs``: ``gate`` and ``up``,
experts x hidden x dim, ``down``, experts x dim x hidden), the layout expert parallelism shards by experts. In
bfloat16 (``bf16-mixed`` or ``bf16-true``) the experts run as three grouped matmuls (``torch._grouped_mm``, one
kernel for all experts, as torchtitan's ``GroupedExperts``); in other precisions, or on a GPU older than the A100,
in a loop over the experts.

Balance: with ``load_balancing_weight`` w, training adds w x the mixtures' mean Switch balance loss
(``Experts.balance_loss``) to the loss. With ``bias_update_rate`` g (DeepSeek-V3's auxiliary-loss-free balancing),
each mixture adds a bias to the scores that choose the experts (not to the weights of their outputs), and after each
optimizer step moves an expert's bias by g towards the mean load (``Experts.update_bias``). Each mixture tallies
its routing in training (each expert's assignments, the dropped ones, the balance loss), which the per-epoch
``experts/*`` metrics report (``project.model_options.expert_balancing.ExpertLoad``) and the bias update reads.
"""

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn import functional as F

from project.models.gpt import LMHead
from project.models.llama import Block, SwiGLU, TokenEmbedding, head_options, init_decoder_parameter
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.options.option_types import NonNegativeFloat, PositiveFloat, PositiveInt

ROUTER_SCORES = ("softmax", "sigmoid")


def holds_values(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has values to route by: not a meta or fake tensor (shapes alone)."""
    return not (tensor.is_meta or is_fake(tensor))


class ExpertMLPs(nn.Module):
    """``num_experts`` SwiGLU MLPs, their weights stacked by projection (``gate`` and ``up``: experts x hidden x dim,
    ``down``: experts x dim x hidden): the part of a mixture that expert parallelism splits by experts."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.up = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert once, on its own rows: ``rows`` sorted by expert, the first ``counts[0]`` expert 0's..."""
        return swiglu_experts(rows, counts, self.gate, self.up, self.down)


def swiglu_experts(
    rows: torch.Tensor, counts: list[int], gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The SwiGLU experts of the stacked weights ``gate``, ``up`` and ``down``, each on its own rows (``rows``
    sorted by expert, ``counts[e]`` of them expert e's), their outputs in the same order: three grouped matmuls
    where ``runs_grouped`` says torch has them, else a loop over the experts."""
    dtype = compute_dtype(rows)
    if runs_grouped(rows, dtype, gate):
        return grouped_swiglu_experts(rows, counts, gate, up, down, dtype)
    return looped_swiglu_experts(rows, counts, gate, up, down)


def grouped_swiglu_experts(
    rows: torch.Tensor,
    counts: list[int],
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``swiglu_experts`` as three ``torch._grouped_mm`` calls in ``dtype``, one kernel each for all experts."""
    # autocast has no policy for _grouped_mm: cast as it casts F.linear's operands
    rows, gate, up, down = (tensor.to(dtype) for tensor in (rows, gate, up, down))
    ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=rows.device)
    hidden = F.silu(torch._grouped_mm(rows, gate.mT, offs=ends)) * torch._grouped_mm(rows, up.mT, offs=ends)
    return torch._grouped_mm(hidden, down.mT, offs=ends)


def looped_swiglu_experts(
    rows: torch.Tensor, counts: list[int], gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """``swiglu_experts`` as a loop over the experts, three ``F.linear`` each. The weights are unbound once, not
    indexed per expert: each index's backward would make a zero gradient of the whole stack (experts squared times
    an expert's weights, written and added), unbind's stacks the experts' gradients once."""
    return torch.cat(
        [
            F.linear(F.silu(F.linear(part, g)) * F.linear(part, u), d)
            for part, g, u, d in zip(rows.split(counts), gate.unbind(0), up.unbind(0), down.unbind(0), strict=True)
        ]
    )


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of ``tensor`` computes in: autocast's where it is on for its device, else its own."""
    device = tensor.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype


def runs_grouped(rows: torch.Tensor, dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs the experts of ``rows`` (computing in ``dtype``, weights shaped as
    ``weight``): it takes bfloat16 alone (its meta kernel, which the memory plan runs, refuses the rest); on CUDA
    it needs compute capability 8.0 and rows of 16-byte multiples. Elsewhere the experts run in a loop."""
    if dtype != torch.bfloat16:
        return False
    if rows.is_cuda:
        aligned = all(size % 8 == 0 for size in weight.shape[1:])  # 8 bfloat16 values: 16 bytes
        return aligned and torch.cuda.get_device_capability(rows.device) >= (8, 0)
    return True


class Experts(nn.Module):
    """A router, ``num_experts`` SwiGLU experts (``experts``) and optionally a shared one: a mixture-of-experts
    MLP. In training it keeps its balance loss times ``load_balancing_weight`` (``auxiliary_loss``), which the
    training step adds to the loss, and a tally of its routing (``take_tally``), which the epoch's metrics read."""

    score_bias: torch.Tensor  # a buffer, registered with a bias_update_rate

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        experts_per_token: int,
        router_scores: str,
        normalize_weights: bool,
        capacity_factor: float | None,
        shared_hidden_dim: int | None,
        load_balancing_weight: float = 0.0,
        bias_update_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_experts, self.experts_per_token = num_experts, experts_per_token
        self.router_scores, self.normalize_weights = router_scores, normalize_weights
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = ExpertMLPs(num_experts, dim, hidden_dim)
        self.shared = SwiGLU(dim, shared_hidden_dim) if shared_hidden_dim else None
        self.load_balancing_weight = load_balancing_weight
        self.bias_update_rate = bias_update_rate
        if bias_update_rate:  # DeepSeek-V3's balancing without a loss: added to the scores that choose, not weigh
            self.register_buffer("score_bias", torch.zeros(num_experts))
        self.auxiliary_loss: torch.Tensor | None = None  # the last training forward's weighted balance loss
        self.tally: RoutingTally | None = None  # what the router did since take_tally

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For each token of ``x`` (tokens x dim): its experts (tokens x experts_per_token), their weights, and its
        probability over all the experts (float32, tokens x experts: the softmax, or the sigmoids normalised to sum
        to 1, as DeepSeek-V3's balance loss takes them), which the balance loss reads."""
        logits = self.router(x).float()  # scores in float32, as transformers' routers compute them
        scores = logits.softmax(dim=-1) if self.router_scores == "softmax" else logits.sigmoid()
        if self.bias_update_rate:
            chosen = (scores + self.score_bias).topk(self.experts_per_token, dim=-1).indices
            weights = scores.gather(-1, chosen)
        else:
            weights, chosen = scores.topk(self.experts_per_token, dim=-1)
        if self.normalize_weights:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        probabilities = scores if self.router_scores == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype), probabilities

    def balance_loss(self, counts: torch.Tensor, probabilities: torch.Tensor) -> torch.Tensor:
        """The Switch Transformer's load-balancing loss of a batch, as transformers' ``load_balancing_loss_func``
        computes it for one layer: ``num_experts`` x the sum over the experts of (its assignments per token) x (its
        mean probability). It is ``experts_per_token`` when the load and the probabilities are even, and more as they
        gather on the same experts; its gradient reaches the router through the probabilities."""
        per_token = counts.to(probabilities.dtype) / probabilities.shape[0]
        return self.num_experts * (per_token * probabilities.mean(dim=0)).sum()

    def capacity(self, tokens: int) -> int | None:
        """The most assignments an expert takes of a training batch of ``tokens`` tokens (None: no limit). In
        evaluation none is dropped: the outputs do not depend on how the tokens are batched."""
        if self.capacity_factor is None or not self.training:
            return None
        return math.ceil(self.capacity_factor * tokens * self.experts_per_token / self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dim = x.shape, x.shape[-1]
        x = x.reshape(-1, dim)
        chosen, weights, probabilities = self.route(x)
        assignments = chosen.reshape(-1)
        order = assignments.argsort(stable=True)  # by expert; within one, in token order
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.scatter_add_(0, assignments, torch.ones_like(assignments))
        taken = self.taken(counts, x.shape[0])
        kept = order
        capacity = self.capacity(x.shape[0])
        if capacity is not None and not holds_values(order):  # shapes alone: the kept assignments' count
            kept = order[: sum(taken)]
        elif capacity is not None:  # each expert's first `capacity` assignments
            starts = torch.cumsum(counts, 0) - counts
            rank = torch.arange(order.numel(), device=x.device) - starts.repeat_interleave(counts)
            kept = order[rank < capacity]
        tokens = kept // self.experts_per_token
        if self.training:
            self._note(counts, kept, probabilities)
        y = self.experts(x[tokens], taken) * weights.reshape(-1)[kept, None]
        out = torch.zeros_like(x).index_add_(0, tokens, y)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape)

    def taken(self, counts: torch.Tensor, tokens: int) -> list[int]:
        """How many assignments each expert takes: its count, at most the capacity. On tensors without values (the
        memory plan's fake tensors, the meta device), which hold no routing, the assignments spread evenly."""
        if not holds_values(counts):
            total = tokens * self.experts_per_token
            counts_list = [total // self.num_experts + (e < total % self.num_experts) for e in range(self.num_experts)]
        else:
            counts_list = counts.tolist()
        capacity = self.capacity(tokens)
        return counts_list if capacity is None else [min(count, capacity) for count in counts_list]

    def _note(self, counts: torch.Tensor, kept: torch.Tensor, probabilities: torch.Tensor) -> None:
        """A training forward's balance loss (``auxiliary_loss``, weighted, in the graph, when the weight is not 0)
        and its tally. Not in a checkpointed block's recompute, which runs inside backward: counted twice else."""
        balance = self.balance_loss(counts, probabilities)
        self.auxiliary_loss = self.load_balancing_weight * balance if self.load_balancing_weight else None
        if not holds_values(counts) or torch._C._current_graph_task_id() != -1:  # a plan's, or a recompute
            return
        dropped = counts.sum() - kept.numel()
        if self.tally is None:
            self.tally = RoutingTally(counts.clone(), dropped, balance.detach(), 1)
        else:
            self.tally.add(counts, dropped, balance.detach())

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3's update after a step of ``load`` (each expert's assignments, every data-parallel rank's):
        an expert's score bias goes up by ``bias_update_rate`` if it had fewer than the mean, down if more."""
        load = load.to(self.score_bias.dtype)
        self.score_bias += self.bias_update_rate * torch.sign(load.mean() - load)

    def take_tally(self) -> "RoutingTally | None":
        """The tally since the last call (None: no training forward since), and a fresh one begun."""
        tally, self.tally = self.tally, None
        return tally


@dataclass
class RoutingTally:
    """What a mixture's router did in training forwards: each expert's assignments (``load``, before a capacity
    drops any), the assignments dropped, the sum of the forwards' balance losses, and the forwards."""

    load: torch.Tensor
    dropped: torch.Tensor
    balance: torch.Tensor
    forwards: int

    def add(self, load: torch.Tensor, dropped: torch.Tensor, balance: torch.Tensor) -> None:
        self.load += load
        self.dropped += dropped
        self.balance += balance
        self.forwards += 1


def mixtures(net: nn.Module) -> dict[int, Experts]:
    """The mixtures of ``net``'s blocks this rank holds, by block index (a pipeline stage holds some)."""
    blocks = getattr(net, "blocks", [])
    return {index: block.mlp for index, block in enumerate(blocks) if isinstance(getattr(block, "mlp", None), Experts)}


def auxiliary_loss(net: nn.Module) -> torch.Tensor | None:
    """The weighted balance losses of ``net``'s last training forward, summed over its mixtures (None: none)."""
    losses = [mixture.auxiliary_loss for mixture in mixtures(net).values() if mixture.auxiliary_loss is not None]
    return torch.stack(losses).sum() if losses else None


class MoE(BlockSequence):
    """Decoder-only transformer of mixture-of-experts blocks, token ids (batch, length) to next-token logits.

    Llama's options (``project.models.Llama``; ``hidden_dim``: the dense blocks' MLP width), and: ``num_experts``,
    ``experts_per_token``, ``expert_hidden_dim`` (each expert's MLP width), ``first_dense_layers`` (blocks with a
    dense MLP before the first mixture, DeepSeek's), ``router_scores`` (softmax or sigmoid), ``normalize_weights``,
    ``capacity_factor`` (null: drop nothing), ``shared_expert_hidden_dim`` (null: no shared expert) and
    ``load_balancing_weight`` (the weight of the mixtures' mean balance loss in the training loss, as transformers'
    ``router_aux_loss_coef``; 0: none) and ``bias_update_rate`` (DeepSeek-V3's balancing without a loss: each
    expert's score bias, which chooses but does not weigh, moved by this much after each step; 0: no bias).
    """

    def __init__(
        self,
        vocab_size: PositiveInt,
        max_length: PositiveInt,
        num_layers: PositiveInt,
        dim: PositiveInt,
        num_heads: PositiveInt,
        num_kv_heads: PositiveInt,
        hidden_dim: PositiveInt,
        num_experts: PositiveInt,
        experts_per_token: PositiveInt,
        expert_hidden_dim: PositiveInt,
        first_dense_layers: int = 0,
        router_scores: str = "softmax",
        normalize_weights: bool = True,
        capacity_factor: PositiveFloat | None = None,
        shared_expert_hidden_dim: PositiveInt | None = None,
        load_balancing_weight: NonNegativeFloat = 0.0,
        bias_update_rate: NonNegativeFloat = 0.0,
        rope_theta: PositiveFloat = 500000.0,
        rope_scaling: dict | None = None,
        norm_eps: PositiveFloat = 1e-5,
        tie_weights: bool = False,
        head_dim: PositiveInt | None = None,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        if experts_per_token > num_experts:
            raise ConfigError(
                "model.net.experts_per_token",
                f"is {experts_per_token}, more than the {num_experts} experts (model.net.num_experts).",
                f"choose at most {num_experts} experts per token.",
            )
        if router_scores not in ROUTER_SCORES:
            raise ConfigError(
                "model.net.router_scores", f"is {router_scores!r}.", f"choose one of {list(ROUTER_SCORES)}."
            )
        if not 0 <= first_dense_layers <= num_layers:
            raise ConfigError(
                "model.net.first_dense_layers",
                f"is {first_dense_layers}, outside 0 to the {num_layers} blocks (model.net.num_layers).",
                "give how many of the first blocks have a dense MLP, e.g. 0.",
            )
        heads = head_options(dim, num_heads, num_kv_heads, head_dim, False, qk_norm, norm_eps)
        rope = (rope_theta, dict(rope_scaling) if rope_scaling else None)

        def mlp(index: int) -> nn.Module:
            if index < first_dense_layers:
                return SwiGLU(dim, hidden_dim)
            return Experts(
                dim,
                expert_hidden_dim,
                num_experts,
                experts_per_token,
                router_scores,
                normalize_weights,
                capacity_factor,
                shared_expert_hidden_dim,
                load_balancing_weight / (num_layers - first_dense_layers),  # the mean over the mixtures
                bias_update_rate,
            )

        self.stem = TokenEmbedding(vocab_size, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, rope, mlp(index)) for index in range(num_layers))
        self.head = LMHead(dim, vocab_size, nn.RMSNorm(dim, eps=norm_eps))
        if tie_weights:
            self.head.output.weight = self.stem.tokens.weight
        self.num_layers, self.num_experts = num_layers, num_experts

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """As Llama's: normal with std 0.02, the projections into the residual stream (attention output, every
        MLP's and expert's down) scaled down by sqrt(2 x layers); norms 1."""
        residual = ("attention.o.weight", "mlp.down.weight", "experts.down", "shared.down.weight")
        init_decoder_parameter(self, name, tensor, generator, residual)
