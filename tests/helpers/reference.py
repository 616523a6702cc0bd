"""A hand-written training loop: the independent reference every strategy must match, epoch by epoch.

Plain PyTorch. Only the model class (with its seeded initial weights) and the data generation come from the
project; the epoch's sample order, the batching, the loss averaging, the optimizer and its weight-decay groups,
the learning-rate schedule and the metrics are written here from their definitions. With ``model.lora``, the
adapters are Hugging Face ``peft``'s, given the project's seeded initial values; with its ``quantize_base``
(QLoRA), the blocks' Linear weights are replaced by their NF4 round trip through torchao's own quantize and
dequantize, and the loop trains on those plain float32 weights. For a mixture of experts, the loop reads each
router's logits (a forward hook) and counts each expert's assignments, the dropped ones and the balance loss from
them (softmax routers: transformers' ``load_balancing_loss_func``), adding ``load_balancing_weight`` x their mean to
the loss. Strategies that agree with each other can share a bug; they cannot share one with this loop.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from project.models import MoE, init_weights


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The documented order of epoch ``epoch``: a permutation drawn from ``seed + epoch`` alone."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch))


# A target not trained on (data=chat's prompts and padding): its loss counts as 0, and it is not a token of the means.
IGNORED = -100


def element_losses(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every prediction: one per sample (classification) or per token (language model); 0 for an
    ignored target."""
    return F.cross_entropy(
        outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1), reduction="none", ignore_index=IGNORED
    )


def warmup_cosine_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then a cosine from 1 down to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * progress)) / 2


def decayed_and_spared(net: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """GPT-2's rule, stated positively: weight decay applies to the weight matrices of Linear layers only. Frozen
    parameters are in neither group."""
    decayed = [module.weight for module in net.modules() if isinstance(module, nn.Linear)]
    decayed = [p for p in decayed if p.requires_grad]
    spared = [p for p in net.parameters() if p.requires_grad and all(p is not d for d in decayed)]
    return decayed, spared


@torch.no_grad()
def as_nf4_round_trip(net: nn.Module) -> None:
    """Replace every Linear weight of ``net``'s blocks by torchao's dequantization of its NF4 quantization (64-weight
    blocks, maxima quantized 256 blocks at a time): the values a QLoRA run computes with."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    for module in net.blocks.modules():
        if isinstance(module, nn.Linear):
            module.weight.copy_(to_nf4(module.weight, 64, 256).get_original_weight())


def with_peft_lora(net: nn.Module, cfg: DictConfig) -> nn.Module:
    """``net`` with ``peft``'s LoRA on the layers ``model.lora.targets`` names, every other weight frozen, and each
    adapter starting from the value this project draws for it from the seed (its own name, ``lora_a``/``lora_b``,
    for peft's ``lora_A.default``/``lora_B.default``)."""
    from peft import LoraConfig, get_peft_model

    from project.models.init import initial_value
    from project.models.lora import LoRA, apply_lora

    lora = cfg.model.lora
    settings = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.targets)
    )
    peft_net = get_peft_model(net, settings)
    with torch.device("meta"):
        seeded = instantiate(cfg.model.net)
    apply_lora(seeded, LoRA(lora.rank, lora.alpha, lora.dropout, tuple(lora.targets)))
    adapters = {name: parameter for name, parameter in peft_net.named_parameters() if parameter.requires_grad}
    with torch.no_grad():
        for name, parameter in adapters.items():
            ours = name.removeprefix("base_model.model.").replace(".lora_A.default.", ".lora_a.")
            parameter.copy_(initial_value(seeded, ours.replace(".lora_B.default.", ".lora_b."), cfg.seed))
    return peft_net


def build_optimizer(cfg: DictConfig, net: nn.Module) -> torch.optim.Optimizer:
    """The optimizer the config names, with its hyperparameters, over weight-decayed and spared groups."""
    options = {key: value for key, value in cfg.model.optimizer.items() if not key.startswith("_")}
    options.pop("fused", None)  # parameter by parameter here: the framework's fused kernel must give the same steps
    if cfg.model.optimizer._target_ == "torch.optim.SGD":
        return torch.optim.SGD(net.parameters(), **options)
    assert cfg.model.optimizer._target_ == "torch.optim.AdamW"
    decayed, spared = decayed_and_spared(net)
    options["betas"] = tuple(options["betas"])
    return torch.optim.AdamW([{"params": decayed}, {"params": spared, "weight_decay": 0.0}], **options)


def lr_factor(cfg: DictConfig, total_steps: int) -> Callable[[int], float]:
    scheduler = cfg.model.scheduler
    if scheduler is None:
        return lambda step: 1.0
    if scheduler._target_.endswith("warmup_linear"):  # TRL's default, as transformers computes it
        from transformers import get_linear_schedule_with_warmup

        assert scheduler.total_steps is None and scheduler.min_lr_ratio == 0  # transformers' own

        warmup = scheduler.warmup_steps or round((scheduler.warmup_fraction or 0) * total_steps)
        dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        return get_linear_schedule_with_warmup(dummy, warmup, total_steps).lr_lambdas[0]
    assert scheduler._target_.endswith("warmup_cosine") and scheduler.total_steps is None
    warmup = (
        scheduler.warmup_steps if scheduler.warmup_steps is not None else round(scheduler.warmup_fraction * total_steps)
    )
    return lambda step: warmup_cosine_factor(step, warmup, total_steps, scheduler.min_lr_ratio)


class RouterCounts:
    """A mixture's routing, counted by hand from its routers' logits (forward hooks), each training forward:
    per mixture, each expert's assignments (the top ``experts_per_token`` scores), the assignments beyond the
    capacity, and the balance loss (kept in the graph: ``balance_losses``, to be added to the loss)."""

    def __init__(self, net: MoE, options: DictConfig) -> None:
        self.options = options
        self.logits: list[torch.Tensor] = []
        self.mixtures = [block.mlp for block in net.blocks if hasattr(block.mlp, "router")]
        self.routers = [mixture.router for mixture in self.mixtures]
        # DeepSeek-V3's score bias, kept and moved here, and written into the model, whose routing adds it
        self.rate = options.get("bias_update_rate", 0.0)
        self.bias = torch.zeros(len(self.routers), options.num_experts)
        self.step_load = torch.zeros(len(self.routers), options.num_experts, dtype=torch.long)
        for router in self.routers:
            router.register_forward_hook(self._keep)
        self.reset()

    def _keep(self, module: nn.Module, inputs: tuple, logits: torch.Tensor) -> None:
        if module.training:
            self.logits.append(logits)

    def reset(self) -> None:
        experts = self.options.num_experts
        self.load = torch.zeros(len(self.routers), experts, dtype=torch.long)
        self.dropped, self.balance, self.forwards = 0, torch.zeros(len(self.routers), dtype=torch.float64), 0

    def balance_losses(self) -> list[torch.Tensor]:
        """The last forward's balance loss of each mixture, its counts added to the epoch's."""
        options, k = self.options, self.options.experts_per_token
        losses = []
        for layer, logits in enumerate(self.logits):
            logits = logits.float()
            tokens, experts = logits.shape
            bias = self.bias[layer].to(logits.device)
            if options.router_scores == "softmax":
                chosen = (logits.softmax(-1) + bias).topk(k, dim=-1).indices
                loss = load_balancing_loss_func((logits,), experts, k)
            else:  # the sigmoids normalised to sum to 1 (DeepSeek-V3's), in the Switch form
                scores = logits.sigmoid()
                chosen = (scores + bias).topk(k, dim=-1).indices
                share = F.one_hot(chosen, experts).sum(1).double().mean(0)
                loss = experts * (share * (scores / scores.sum(-1, keepdim=True)).double().mean(0)).sum()
            counts = torch.bincount(chosen.flatten().cpu(), minlength=experts)
            if options.capacity_factor is not None:
                capacity = math.ceil(options.capacity_factor * tokens * k / experts)
                self.dropped += int((counts - capacity).clamp(min=0).sum())
            self.load[layer] += counts
            self.step_load[layer] += counts
            self.balance[layer] += float(loss.detach())
            losses.append(loss)
        self.forwards += 1
        self.logits.clear()
        return losses

    def step(self) -> None:
        """After an optimizer step: each expert's bias up by the rate if its load in the step was under the mean
        over the experts, down if over (DeepSeek-V3, section 2.1.2)."""
        if self.rate:
            load = self.step_load.float()
            self.bias += self.rate * torch.sign(load.mean(1, keepdim=True) - load)
            for mixture, bias in zip(self.mixtures, self.bias, strict=True):
                mixture.score_bias.copy_(bias)
        self.step_load.zero_()

    def metrics(self) -> dict[str, float]:
        load = self.load.double()
        shares = load.sum(0) / load.sum()
        return {
            "experts/balance_loss": (self.balance / self.forwards).mean().item(),
            "experts/imbalance": (load.max(1).values / load.mean(1)).mean().item(),
            "experts/dropped_share": self.dropped / load.sum().item(),
            **{f"experts/load/{expert}": share.item() for expert, share in enumerate(shares)},
        }


@dataclass
class ReferenceRun:
    history: list[dict[str, float]]  # per epoch: train/loss, val/loss, val/acc or val/perplexity (and train/acc)
    net: nn.Module
    optimizer: torch.optim.Optimizer
    clipped_steps: int  # optimizer steps whose gradient norm was above the clipping threshold


def reference_run(
    cfg: DictConfig,
    global_batch: int,
    device: str = "cpu",
    autocast: torch.dtype | None = None,
    forwards: int = 1,
) -> ReferenceRun:
    """Train the configured model on the configured data for ``trainer.max_epochs`` epochs, ``global_batch``
    samples per batch, with the config's gradient accumulation and gradient-norm clipping, on ``device``; with
    ``autocast`` (torch.bfloat16), forward and loss under ``torch.autocast`` in that dtype, the weights and the
    optimizer in float32 (mixed precision as torch documents it). Each batch runs as ``forwards`` forwards of its
    equal consecutive slices (the data-parallel ranks' slices, in rank order), their gradients averaged: the same
    step, except where a forward depends on the tokens it sees together (a mixture's capacity and balance loss)."""
    torch.manual_seed(0)  # only so that nothing below depends on the test order; the weights come from cfg.seed
    data = instantiate(cfg.data)
    data.setup("fit")
    (x, y), (x_val, y_val) = (
        [tensor.to(device) for tensor in split.tensors] for split in (data.train_set, data.val_set)
    )
    net = init_weights(instantiate(cfg.model.net), cfg.seed)
    if cfg.model.get("lora") is not None and cfg.model.lora.rank:
        if cfg.model.lora.get("quantize_base"):
            as_nf4_round_trip(net)
        net = with_peft_lora(net, cfg)
    net = net.to(device)
    routing = RouterCounts(net, cfg.model.net) if isinstance(net, MoE) else None
    balance_weight = cfg.model.net.get("load_balancing_weight", 0.0) if routing is not None else 0.0
    mixed = torch.autocast(torch.device(device).type, dtype=autocast, enabled=autocast is not None)
    batches_per_epoch = len(x) // global_batch
    accumulate, clip = cfg.trainer.accumulate_grad_batches, cfg.trainer.gradient_clip_val
    epochs = cfg.trainer.max_epochs
    optimizer = build_optimizer(cfg, net)
    steps_per_epoch = math.ceil(batches_per_epoch / accumulate)  # the epoch's last, shorter accumulation steps too
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, epochs * steps_per_epoch))
    classification = y.dim() == 1
    history, clipped_steps = [], 0
    for epoch in range(epochs):
        order = epoch_order(len(x), cfg.seed, epoch).to(device)
        loss_sum, correct, count = 0.0, 0, 0
        optimizer.zero_grad()
        for index in range(batches_per_epoch):
            batch = order[index * global_batch : (index + 1) * global_batch]
            for part in batch.chunk(forwards):
                with mixed:
                    outputs = net(x[part])
                    losses = element_losses(outputs, y[part])
                # The mean over an accumulation of equal batches: of every position, its ignored targets counting 0
                # (project.tasks.language_model.TokenCrossEntropy's definition).
                loss = losses.mean()
                if routing is not None:
                    balance = routing.balance_losses()
                    loss = loss + balance_weight * torch.stack(balance).mean() if balance_weight else loss
                (loss / (accumulate * forwards)).backward()
                loss_sum += losses.double().sum().item()
                count += (y[part] != IGNORED).sum().item()  # the metrics: the mean over trained targets
                if classification:
                    correct += (outputs.argmax(-1) == y[part]).sum().item()
            if (index + 1) % accumulate == 0 or index + 1 == batches_per_epoch:
                if clip is not None:
                    grads = [p.grad for p in net.parameters() if p.grad is not None]
                    norm = torch.linalg.vector_norm(torch.stack([grad.norm() for grad in grads]))
                    clipped_steps += int(norm > clip)
                    torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
                optimizer.step()
                schedule.step()
                if routing is not None:
                    routing.step()
                optimizer.zero_grad()
        net.eval()  # evaluation as torch defines it (a mixture of experts drops no token there)
        with torch.no_grad(), mixed:
            outputs = net(x_val)
            val_losses = element_losses(outputs, y_val)
        net.train()
        val_loss = (val_losses.double().sum() / (y_val != IGNORED).sum()).item()
        row = {"train/loss": loss_sum / count, "val/loss": val_loss}
        if routing is not None:
            row.update(routing.metrics())
            routing.reset()
        if classification:
            row["train/acc"] = correct / count
            row["val/acc"] = (outputs.argmax(-1) == y_val).double().mean().item()
        else:
            row["val/perplexity"] = math.exp(val_loss)
        history.append(row)
    return ReferenceRun(history, net, optimizer, clipped_steps)
