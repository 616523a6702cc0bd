"""GRPO (project/tasks/grpo.py): its arithmetic (project/tasks/group_relative.py) against TRL's own
``GRPOTrainer`` (TRL 1.16) and the definitions in plain Python; every strategy against a hand-written GRPO loop."""

import contextlib
import copy
import hashlib
import importlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, isolated_env, only_run, run_command, train, two_job_sweep
from helpers.reference import build_optimizer, epoch_order, lr_factor, with_peft_lora
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from test_memory_plan import resolved

from project.checkpointing.hf import HFWeights, net_options, read_config
from project.cli.chat_example import write_example
from project.data.targets import IGNORE_INDEX
from project.job.job import Job
from project.parallel.parallelize import materialize
from project.plan.memory_plan import plan_memory
from project.plan.simulate import generation_flops
from project.plan.step_time import predict_step
from project.tasks.group_relative import (
    PolicyLoss,
    completion_rewards,
    entropy,
    group_advantages,
    nan_std,
    token_log_probs,
)


def trl_grpo_loss(
    loss: PolicyLoss,
    log_probs: torch.Tensor,
    entropies: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    reference: torch.Tensor | None,
):
    """TRL's ``GRPOTrainer._compute_loss`` on these per-token log-probabilities and entropies (what its fused head
    returns), one process, no accumulation: its loss and the metrics it records. The trainer is only the attributes
    the method reads, TRL's defaults for the rest (``GRPOConfig``: token-level importance sampling, the KL's bias
    correction, no entropy bonus or mask, no vLLM)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    rows, length = log_probs.shape
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (log_probs, entropies, None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=loss.beta,
        args=SimpleNamespace(use_bias_correction_kl=True, delta=None, steps_per_generation=1),
        loss_type=loss.loss_type,
        epsilon_low=loss.epsilon,
        epsilon_high=loss.epsilon if loss.epsilon_high is None else loss.epsilon_high,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=loss.max_completion_length,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.zeros(rows, 3, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 3, dtype=torch.long),
        "completion_ids": torch.zeros(rows, length, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "num_items_in_batch": mask.sum(),
        **({"ref_per_token_logps": reference} if reference is not None else {}),
    }
    value = GRPOTrainer._compute_loss(trainer, None, inputs)
    return value, {key: values[-1] for key, values in trainer._metrics["train"].items()}


CASES = {
    "grpo": PolicyLoss(loss_type="grpo"),
    "dr_grpo": PolicyLoss(loss_type="dr_grpo", max_completion_length=9),
    "dapo": PolicyLoss(loss_type="dapo", epsilon_high=0.28),
    "grpo+kl": PolicyLoss(loss_type="grpo", beta=0.04),
    "dr_grpo+kl": PolicyLoss(loss_type="dr_grpo", beta=0.04, max_completion_length=9),
    "dapo+kl": PolicyLoss(loss_type="dapo", beta=0.04, epsilon_high=0.28),
}


@pytest.mark.parametrize("name", CASES)
def test_the_loss_its_gradient_and_metrics_are_trls(name):
    """Completions of different lengths (padding after each one's end), at temperature 0.7: the loss, its gradient
    with respect to the logits, the KL, the entropy and the clip ratios, as TRL computes them from the same
    log-probabilities; the log-probabilities and entropies TRL is handed are computed its way (a log-softmax of the
    scaled logits, gathered; TRL's ``entropy_from_logits``), ours by this project's functions."""
    pytest.importorskip("trl")
    from trl.trainer.utils import entropy_from_logits

    loss = CASES[name]
    torch.manual_seed(0)
    rows, length, vocab, temperature = 6, 9, 13, 0.7
    logits = torch.randn(rows, length, vocab, dtype=torch.float64, requires_grad=True)
    completion = torch.randint(vocab, (rows, length))
    ends = torch.tensor([9, 4, 7, 1, 9, 6])  # each completion's tokens
    mask = torch.arange(length)[None] < ends[:, None]
    target = completion.masked_fill(~mask, IGNORE_INDEX)
    advantages = torch.randn(rows, dtype=torch.float64)
    reference = -torch.rand(rows, length, dtype=torch.float64) * 3 if loss.beta else None

    scaled = logits / temperature
    trl_log_probs = scaled.log_softmax(-1).gather(-1, completion[..., None]).squeeze(-1)
    trl_entropies = entropy_from_logits(scaled.detach())
    expected, metrics = trl_grpo_loss(loss, trl_log_probs, trl_entropies, mask, advantages, reference)
    (expected_grad,) = torch.autograd.grad(expected, logits)

    log_probs = token_log_probs(logits.double(), target, temperature).double()
    value, terms = loss(log_probs, mask, advantages, reference, step_tokens_per_rank=mask.sum())
    (grad,) = torch.autograd.grad(value, logits)
    assert value.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-9)
    tokens = mask.sum().item()
    assert (entropy(scaled) * mask).sum().item() / tokens == pytest.approx(metrics["entropy"], rel=1e-6)
    assert terms.low_clipped.sum().item() / tokens == metrics["clip_ratio/low_mean"]
    assert terms.high_clipped.sum().item() / tokens == metrics["clip_ratio/high_mean"]
    if loss.beta:
        assert terms.kl is not None
        assert terms.kl.sum().item() / tokens == pytest.approx(metrics["kl"], rel=1e-6)
    else:
        assert terms.kl is None and "kl" not in metrics


def test_the_loss_by_hand():
    """Two completions, plain floats: on-policy the ratio is 1, so ``grpo``'s loss is minus the mean over completions
    of the advantage (each completion's tokens averaged), ``dapo``'s minus the tokens' mean advantage, ``dr_grpo``'s
    the advantages' sum over tokens divided by completions x max length; each gradient with respect to a token's
    log-probability is minus its advantage over that divisor."""
    log_probs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages = torch.tensor([0.5, -2.0], dtype=torch.float64)
    expected = {
        "grpo": (-(0.5 * 3 / 3 + -2.0 * 2 / 2) / 2, [[-0.5 / 3 / 2] * 3, [2.0 / 2 / 2] * 2 + [0.0]]),
        "dapo": (-(0.5 * 3 - 2.0 * 2) / 5, [[-0.5 / 5] * 3, [2.0 / 5] * 2 + [0.0]]),
        "dr_grpo": (-(0.5 * 3 - 2.0 * 2) / (2 * 4), [[-0.5 / 8] * 3, [2.0 / 8] * 2 + [0.0]]),
    }
    for loss_type, (value, gradient) in expected.items():
        loss = PolicyLoss(loss_type=loss_type, max_completion_length=4)  # type: ignore[arg-type]
        result, _ = loss(log_probs, mask, advantages, step_tokens_per_rank=5)
        (grad,) = torch.autograd.grad(result, log_probs)
        assert result.item() == pytest.approx(value, rel=1e-12), loss_type
        torch.testing.assert_close(grad, torch.tensor(gradient, dtype=torch.float64))


def test_advantages_are_each_groups_standard_scores():
    """Two groups of four, one completion unscored (NaN) and one group all alike: each advantage from the
    definition with Python's ``statistics`` (the sample standard deviation), the unscored and the alike group's 0;
    TRL's ``nanstd`` agrees with ours; ``batch`` takes the whole step's deviation; ``none`` divides by nothing."""
    pytest.importorskip("trl")
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, math.nan, 0.5, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    scored = [1.0, 0.0, 0.5]
    mean, std = statistics.mean(scored), statistics.stdev(scored)
    advantages, zero_std = group_advantages(rewards, 4, "group")
    expected = [(value - mean) / (std + 1e-4) for value in (1.0, 0.0)] + [0.0, (0.5 - mean) / (std + 1e-4)]
    torch.testing.assert_close(advantages, torch.tensor(expected + [0.0] * 4, dtype=torch.float64))
    assert zero_std.tolist() == [False] * 4 + [True] * 4
    torch.testing.assert_close(nan_std(rewards.view(2, 4), 1), nanstd(rewards.view(2, 4), dim=1))
    torch.testing.assert_close(nan_std(rewards), nanstd(rewards))

    all_scored = [value for value in rewards.tolist() if not math.isnan(value)]
    batch_std = statistics.stdev(all_scored)
    advantages, zero_std = group_advantages(rewards, 4, "batch")
    group_means = [mean] * 4 + [2.0] * 4
    expected = [(r - m) / (batch_std + 1e-4) for r, m in zip(rewards.tolist(), group_means)]
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64).nan_to_num(0.0))
    assert not zero_std.any()
    advantages, _ = group_advantages(rewards, 4, "none")
    expected = [r - m for r, m in zip(rewards.tolist(), group_means)]
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64).nan_to_num(0.0))


def test_rewards_are_weighted_sums_of_the_scores_given():
    """A completion's reward is its scores' weighted sum over the functions that scored it; none scored: NaN."""
    scores = torch.tensor([[1.0, 2.0], [math.nan, 3.0], [math.nan, math.nan]])
    rewards = completion_rewards(scores, torch.tensor([0.5, 2.0]))
    assert rewards[:2].tolist() == [4.5, 6.0] and rewards[2].isnan()


# Every strategy against a hand-written GRPO loop

REWARDS = Path(__file__).parent / "helpers" / "grpo_rewards.py"
GRPO_OVERRIDES = [
    "experiment=grpo",
    "model=qwen3",
    "data.seq_length=32",
    "data.batch_size=4",
    "data.val_fraction=0.2",
    f"model.grpo.reward_functions=[{REWARDS}:vowel_share,{REWARDS}:names_the_person]",
    "model.grpo.reward_weights=[1.0,0.5]",
    "model.grpo.num_generations=4",
    "model.grpo.max_completion_length=8",
    "model.optimizer.lr=0.003",
    "trainer.max_epochs=2",
    "trainer.accumulate_grad_batches=2",
    "print_config=false",
    "~callbacks.progress_bar",
    "+trainer.enable_progress_bar=false",
]
STOP = "<|im_end|>"


@pytest.fixture(scope="session")
def prompt_example(shared_tmp, home) -> tuple[Path, Path]:
    """A base that greets (the chat example's tiny Qwen 3 trained on its greetings, exported: its completions end
    at the end of turn, at different lengths) and 40 prompts: 32 training, 8 validation."""
    out = shared_tmp / "grpo-example"
    if not (out / "base" / "model.safetensors").is_file():
        model_dir = write_example(out, count=40)
        chat = [f"data.path={out / 'greetings.jsonl'}", "data.seq_length=32", "model.optimizer.lr=0.01"]
        run = [f"model.init_from={model_dir}", "model=qwen3", "data=chat", *chat, "trainer.max_epochs=6"]
        train([*run, f"hydra.run.dir={out / 'base-run'}", "logger=csv"], home)
        export = [sys.executable, "-m", "project.cli.export", str(out / "base-run" / "checkpoints" / "last.ckpt")]
        result = run_command([*export, str(out / "base")], home)
        assert result.returncode == 0, result.output[-3000:]
    return out / "base", out / "prompts.jsonl"


def prompt_seed(seed: int, split: str, epoch: int, index: int) -> int:
    """The documented seed of a prompt's draws: the first 8 bytes of sha256("seed:split:epoch:index"), halved."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{split}:{epoch}:{index}".encode()).digest()[:8], "little") >> 1


def hand_written_grpo(cfg: DictConfig, global_batch: int) -> list[dict[str, float]]:
    """GRPO as the papers and TRL write it, in plain PyTorch: each prompt's group drawn token by token from the
    softmax of the last logits over the temperature (a generator per prompt, seeded as documented), up to the end of
    turn; rewards the weighted sum of the functions' scores, a group's advantage (r - mean) / (std + 1e-4); the
    ``dapo`` loss, minus the advantage times the on-policy ratio, with ``model.grpo.beta`` > 0 plus beta times the
    KL estimate exp(ref - logp) - (ref - logp) - 1 to the reference (a copy of the initial model; with LoRA, peft's
    model with its adapters disabled) times the ratio (TRL's default ``use_bias_correction_kl``), summed over the
    global batch's completion tokens and divided by them, accumulated; the metrics, means over the epoch (a
    standard deviation one value a global batch). The data's tensors and records, the tokenizer's decoding and the
    model class come from the project."""
    data = instantiate(cfg.data)
    tokenizer = data.renderer.tokenizer
    stop = tokenizer.token_to_id(STOP)
    grpo = cfg.model.grpo
    groups, temperature, longest = grpo.num_generations, grpo.temperature, grpo.max_completion_length
    module = importlib.import_module("helpers.grpo_rewards")
    functions = [getattr(module, spec.rpartition(":")[2]) for spec in grpo.reward_functions]
    weights = torch.tensor(list(grpo.reward_weights))
    # The shape of the model dir's config.json, as model.init_from gives it.
    cfg = OmegaConf.merge(cfg, {"model": {"net": net_options(read_config(cfg.model.init_from))}})
    with torch.device("meta"):
        net = instantiate(cfg.model.net)
    materialize(net, torch.device("cpu"), cfg.seed, HFWeights(cfg.model.init_from))
    lora, beta = bool(cfg.model.lora.rank), grpo.beta
    if lora:
        net = with_peft_lora(net, cfg)
    reference_net = copy.deepcopy(net) if beta and not lora else None
    train_prompts = data.num_train_samples
    accumulate, epochs = cfg.trainer.accumulate_grad_batches, cfg.trainer.max_epochs
    batches = train_prompts // global_batch
    optimizer = build_optimizer(cfg, net)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, epochs * math.ceil(batches / accumulate)))

    def draw(prompt: torch.Tensor, seed: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        tokens, ended = prompt.repeat(groups, 1), [None] * groups
        net.eval()
        with torch.no_grad():
            for step in range(longest):
                probabilities = torch.softmax(net(tokens)[:, -1].float() / temperature, -1)
                token = torch.multinomial(probabilities, 1, generator=generator)
                for row in range(groups):
                    if ended[row] is None and token[row, 0] == stop:
                        ended[row] = step + 1
                tokens = torch.cat([tokens, token], 1)
        net.train()
        return [tokens[row, len(prompt) : len(prompt) + (end or longest)].tolist() for row, end in enumerate(ended)]

    def batch_values(indices: list[int], split: str, epoch: int) -> tuple[torch.Tensor, dict[str, tuple]]:
        rows, completions, names = [], [], []
        for index in indices:
            prompt = data.inputs[index, : data.targets[index]]
            for ids in draw(prompt, prompt_seed(cfg.seed, split, epoch, index)):
                rows.append((prompt.tolist(), ids))
                completions.append([{"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}])
                names.append(data.records[index][2]["name"])
        prompts = [data.records[index][1] for index in indices for _ in range(groups)]
        ids = [completion for _, completion in rows]
        scores = torch.tensor(
            [
                [
                    math.nan if score is None else score
                    for score in function(prompts=prompts, completions=completions, completion_ids=ids, name=names)
                ]
                for function in functions
            ]
        ).T
        rewards = (scores.nan_to_num(0.0) * weights).sum(1)
        rewards[scores.isnan().all(1)] = math.nan
        advantages, stds = [], []
        for group in rewards.view(-1, groups).tolist():
            scored = [value for value in group if not math.isnan(value)]
            mean = sum(scored) / len(scored)
            std = math.sqrt(sum((value - mean) ** 2 for value in scored) / (len(scored) - 1))
            stds.append(std)
            advantages += [0.0 if math.isnan(value) else (value - mean) / (std + 1e-4) for value in group]
        width = max(len(prompt) + len(completion) for prompt, completion in rows) - 1
        inputs = torch.zeros(len(rows), width, dtype=torch.long)
        targets = torch.full((len(rows), width), IGNORE_INDEX)
        for row, (prompt, completion) in enumerate(rows):
            whole = torch.tensor(prompt + completion)
            inputs[row, : len(whole) - 1] = whole[:-1]
            targets[row, len(prompt) - 1 : len(whole) - 1] = whole[len(prompt) :]

        def log_probs_of(logits: torch.Tensor) -> torch.Tensor:
            return logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)

        logits = net(inputs) / temperature
        mask = targets != IGNORE_INDEX
        log_probs = log_probs_of(logits)
        ratio = torch.exp(log_probs - log_probs.detach())
        per_token = -torch.tensor(advantages)[:, None] * ratio
        if beta:
            training = net.training
            net.eval()
            with torch.no_grad(), net.disable_adapter() if lora else contextlib.nullcontext():
                reference = log_probs_of((net if lora else reference_net)(inputs) / temperature)
            net.train(training)
            kl = (torch.exp(reference - log_probs) - (reference - log_probs) - 1) * ratio
            per_token = per_token + beta * kl
        loss = (per_token * mask).sum() / mask.sum()
        probabilities = logits.detach().double().softmax(-1)  # float64: no float32 softmax underflow in the log
        entropies = -(probabilities * probabilities.log()).sum(-1)
        lengths = torch.tensor([len(completion) for completion in ids], dtype=torch.float64)
        clipped = torch.tensor([len(c) == longest and c[-1] != stop for c in ids], dtype=torch.float64)
        present = ~rewards.isnan()
        values = {
            "loss": (loss.item(), 1),
            "reward": (rewards[present].sum().item(), int(present.sum())),
            "reward_std": (statistics.stdev(rewards[present].tolist()), 1),
            "frac_reward_zero_std": (sum(std == 0 for std in stds) * groups, len(rows)),
            "completions/mean_length": (lengths.sum().item(), len(rows)),
            "completions/clipped_ratio": (clipped.sum().item(), len(rows)),
            "entropy": ((entropies * mask).sum().item(), int(mask.sum())),
        }
        if beta:
            values["kl"] = ((kl.detach() * mask).sum().item(), int(mask.sum()))
        for function, column in zip(functions, scores.T, strict=True):
            given = column[~column.isnan()].tolist()
            values[f"rewards/{function.__name__}/mean"] = (sum(given), len(given))
            values[f"rewards/{function.__name__}/std"] = (statistics.stdev(given), 1)
        return loss, values

    def add(sums: dict[str, list[float]], values: dict[str, tuple]) -> None:
        for key, (total, count) in values.items():
            sums[key][0] += total
            sums[key][1] += count

    history = []
    for epoch in range(epochs):
        order = epoch_order(train_prompts, cfg.seed, epoch).tolist()
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for index in range(batches):
            loss, values = batch_values(order[index * global_batch : (index + 1) * global_batch], "train", epoch)
            (loss / accumulate).backward()
            add(sums, values)
            if (index + 1) % accumulate == 0 or index + 1 == batches:
                torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.trainer.gradient_clip_val)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
        val_sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        val = list(range(train_prompts, len(data.inputs)))
        for start in range(0, len(val), global_batch):
            net.eval()
            with torch.no_grad():
                _, values = batch_values(val[start : start + global_batch], "val", epoch)
            net.train()
            add(val_sums, values)
        row = {f"train/{key}": total / count for key, (total, count) in sums.items()}
        row.update({f"val/{key}": total / count for key, (total, count) in val_sums.items()})
        history.append(row)
    return history


@pytest.fixture(scope="session")
def grpo_runs(prompt_example, runs_dir, home) -> dict[str, Path]:
    """GRPO of the greeting base on the example's prompts: on one device (4 prompts a batch), and under ddp and fsdp
    (2 replicas of 2 prompts) over 2 processes, fsdp with LoRA adapters, and tensor_parallel over 2 ranks (one
    replica of 4 prompts); each prompt drawn 4 times, 2 batches accumulated a step. All but the one-device run with
    the KL term (``KL``): the initial weights as reference, each rank's share of them; with LoRA the base."""
    model_dir, prompts = prompt_example
    data = [f"data.path={prompts}", f"model.init_from={model_dir}"]
    sweep = [*GRPO_OVERRIDES, *data, *KL, "data.batch_size=2", "trainer.devices=2", "strategy=ddp,fsdp"]
    sweep_dir = two_job_sweep("grpo", sweep, runs_dir, home)[1][0].parent
    single = runs_dir / "grpo-single"
    if not (single / "result.json").is_file():
        train([*GRPO_OVERRIDES, *data, f"hydra.run.dir={single}"], home)
    lora = runs_dir / "grpo-fsdp-lora"
    if not (lora / "result.json").is_file():
        train([*GRPO_OVERRIDES, *data, *KL, *LORA, "data.batch_size=2", "trainer.devices=2", "strategy=fsdp",
               f"hydra.run.dir={lora}"], home)  # fmt: skip
    split = runs_dir / "grpo-tensor-parallel"
    if not (split / "result.json").is_file():
        train([*GRPO_OVERRIDES, *data, *KL, *TENSOR_PARALLEL, f"hydra.run.dir={split}"], home)
    runs = {"auto": single, "ddp": sweep_dir / "0", "fsdp": sweep_dir / "1", "fsdp+lora": lora}
    return {**runs, "tensor_parallel": split}


# One replica of 4 prompts over 2 ranks, each layer split: the sequence and the logits whole (GRPO's rule).
TENSOR_PARALLEL = ["strategy=tensor_parallel", "trainer.devices=2"]
TENSOR_PARALLEL += ["strategy.sequence_parallel=false", "strategy.loss_parallel=false"]


LORA = ["model.lora.rank=8", "model.lora.dropout=0", "model.optimizer.lr=0.01"]
KL = ["model.grpo.beta=0.04"]
_HAND_WRITTEN: dict[tuple[bool, bool], list[dict[str, float]]] = {}


# fsdp's draws gather each unit once through FSDP2's internals (gathered_throughout): run on the boxes' torch too.
INTERNALS = pytest.mark.torch_internals
STRATEGIES = ["auto", "ddp", pytest.param("fsdp", marks=INTERNALS), pytest.param("fsdp+lora", marks=INTERNALS)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [*STRATEGIES, "tensor_parallel"])
def test_every_strategy_gives_the_hand_written_loops_numbers(grpo_runs, prompt_example, strategy):
    """Each epoch's loss, rewards (each function's too), lengths, entropy and KL, training and validation, in the
    run's W&B history, equal the hand-written loop's to 1e-5; and the rewards moved: not every group alike. The
    run's W&B table of completions holds each epoch's first validation batch."""
    from test_config import compose_train

    model_dir, prompts = prompt_example
    lora, kl = strategy.endswith("+lora"), strategy != "auto"
    if (lora, kl) not in _HAND_WRITTEN:
        run = [*GRPO_OVERRIDES, f"data.path={prompts}", f"model.init_from={model_dir}", *(LORA if lora else [])]
        _HAND_WRITTEN[lora, kl] = hand_written_grpo(compose_train([*run, *(KL if kl else [])]), global_batch=4)
    expected = _HAND_WRITTEN[lora, kl]
    assert ("train/kl" in expected[0]) == kl and (not kl or expected[-1]["train/kl"] > 1e-4)
    run = only_run(grpo_runs[strategy])
    for key in expected[0]:  # on-policy the loss is a sum of terms near 1 that cancel to near 0: held to 1e-6 apart
        assert run.series(key) == pytest.approx([row[key] for row in expected], rel=1e-5, abs=1e-6), key
    assert all(row["train/frac_reward_zero_std"] < 1 for row in expected)
    table = run.summary["completions"]  # each epoch's first validation batch, rank 0's: 4 prompts, or 2 a replica
    prompts = 4 if strategy in ("auto", "tensor_parallel") else 2  # a replica's
    assert table["_type"] == "table-file" and table["nrows"] == 2 * 4 * prompts
    if lora:
        assert "LoRA (rank 8 on q, v)" in (grpo_runs[strategy] / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["lora", "full"])
def test_a_resumed_run_goes_on_as_the_straight_one(prompt_example, tmp_path, home, weights):
    """GRPO with the KL term on one device, no learning-rate schedule, with LoRA (the base as reference) and with
    full weights (the initial weights as reference, built again by the resumed run, not the checkpoint's): epoch 1
    resumed from epoch 0's checkpoint draws the same completions and gives the straight run's numbers, KL included
    (a resumed run's draws are seeded by epoch and prompt, nothing to save)."""
    model_dir, prompts = prompt_example
    run = [*GRPO_OVERRIDES, f"data.path={prompts}", f"model.init_from={model_dir}", "model.scheduler=null"]
    run += [*(["model.lora.rank=8", "model.lora.dropout=0"] if weights == "lora" else []), *KL, "logger=csv"]
    train([*run, f"hydra.run.dir={tmp_path / 'straight'}"], home)
    train([*run, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'first'}"], home)
    first = tmp_path / "first" / "checkpoints" / "last.ckpt"
    train([*run, f"hydra.run.dir={tmp_path / 'resumed'}", f"ckpt_path={first}"], home)
    straight, resumed = (
        json.loads((tmp_path / name / "result.json").read_text())["history"] for name in ("straight", "resumed")
    )
    assert len(resumed) == 2 and straight[1]["train/kl"] > 1e-4
    keys = [key for key in straight[1] if key.startswith(("train/", "val/"))]
    assert {"train/kl", "val/reward", "train/rewards/vowel_share/mean"} <= set(keys)
    for key in keys:
        assert resumed[1][key] == pytest.approx(straight[1][key], rel=1e-5, abs=1e-6), key


def planned_grpo_job(tmp_path: Path, *overrides: str) -> Job:
    """GRPO of the example's tiny Qwen 3 under fsdp over 2 H100s in bf16: 2 prompts a replica, 4 completions of up
    to 16 tokens each, sequences of 40."""
    model_dir = write_example(tmp_path, count=40)
    return resolved(
        [
            "experiment=grpo",
            "model=qwen3",
            f"model.init_from={model_dir}",
            f"data.path={tmp_path / 'prompts.jsonl'}",
            f"model.grpo.reward_functions=[{tmp_path / 'rewards.py'}:hello]",
            "model.grpo.num_generations=4",
            "model.grpo.max_completion_length=16",
            "data.seq_length=40",
            "data.batch_size=2",
            "strategy=fsdp",
            "trainer.devices=2",
            "cluster=h100_sxm_8x",
            "trainer.precision=bf16-mixed",
            *overrides,
        ]
    )


@pytest.mark.torch_internals
def test_the_plan_prices_each_steps_completions_as_arithmetic_says(tmp_path):
    """GRPO of the example's tiny Qwen 3 under fsdp over 2 H100s in bf16, planned: the step trains batch x
    num_generations rows; the generation inside it holds a key/value cache of 2 (keys, values) x blocks x rows x
    key/value heads x head width x (prompt + completion) positions at 2 bytes, and the whole model gathered at 2
    bytes a parameter; its FLOPs are torch's formulas' (2 a weight a token for each matmul, 4 a query, key and
    head dimension for attention) of each prompt's pass over its group's rows, then of the one-token passes, whose
    keys grow by one a pass."""
    rows, new, length, batch = 4, 16, 40, 2
    job = planned_grpo_job(tmp_path)
    assert job.data.sequences_per_sample == rows and job.tokens_per_step == batch * rows * length
    generation = plan_memory(job, suggest=False).generation
    assert generation is not None and generation.prompts == batch
    net = job.meta_net()
    attention = net.blocks[0].attention
    layers, heads, kv_heads, width = len(net.blocks), attention.num_heads, attention.num_kv_heads, attention.head_dim
    prompt = length + 1 - new
    assert generation.cache == 2 * layers * rows * kv_heads * width * (prompt + new) * 2
    parameters = sum(parameter.numel() for parameter in net.parameters())
    assert generation.gathered == pytest.approx(2 * parameters, rel=0.01)  # FSDP pads each to a multiple of 2 rows
    weights = sum(module.weight.numel() for module in net.modules() if isinstance(module, torch.nn.Linear))
    prompt_pass = rows * prompt * 2 * weights + layers * 4 * rows * heads * width * prompt * prompt
    token_passes = sum(rows * (2 * weights + layers * 4 * heads * width * (prompt + step)) for step in range(1, new))
    assert generation_flops(generation) == batch * (prompt_pass + token_passes)


@pytest.mark.torch_internals
def test_the_plan_holds_and_prices_the_kl_terms_reference(tmp_path):
    """With the KL term and full weights, each device keeps its share of the initial weights (fp32, half of them
    under fsdp over 2), held in its peak; each step runs the reference's forward over the step's rows (2 prompts x
    4 completions of 40 tokens: 2 FLOPs a weight a token, and 4 a query, key and head dimension for attention),
    priced in the step's time."""
    plain, with_kl = (planned_grpo_job(tmp_path, *kl) for kl in ([], ["model.grpo.beta=0.04"]))
    plans = [plan_memory(job, suggest=False) for job in (plain, with_kl)]
    net = plain.meta_net()
    parameters = sum(parameter.numel() for parameter in net.parameters())
    kept = plans[1].devices[0].kept
    assert plans[0].devices[0].kept == 0 and kept == pytest.approx(4 * parameters / 2, rel=0.01)
    # (and the KL term's few tensors in the loss)
    assert plans[1].devices[0].peak - plans[0].devices[0].peak == pytest.approx(kept, rel=0.01)
    reference = plans[1].generation.reference_pass
    assert plans[0].generation.reference_pass is None and reference is not None
    attention = net.blocks[0].attention
    layers, heads, width = len(net.blocks), attention.num_heads, attention.head_dim
    weights = sum(module.weight.numel() for module in net.modules() if isinstance(module, torch.nn.Linear))
    rows, length = 2 * 4, 40
    assert reference.flops == rows * length * 2 * weights + layers * 4 * rows * heads * width * length * length
    steps = [predict_step(plan, job, job.cluster) for plan, job in zip(plans, (plain, with_kl), strict=True)]
    assert steps[0].generation.reference_pass == 0 and steps[1].generation.reference_pass > 0
    # (and the loss's KL ops, a few host dispatches)
    assert steps[1].seconds == pytest.approx(steps[0].seconds + steps[1].generation.reference_pass, rel=0.01)


@pytest.mark.slow
def test_the_pages_qwen3_plan_prints_its_draws_as_stated(tmp_path, home):
    """docs/finetuning.md's plan of GRPO on Qwen 3 0.6B over 8 H100s, run as the page says: it prints the draws'
    line the page shows, and the step's prediction with the generating time the page states."""
    page = (REPO / "docs" / "finetuning.md").read_text()
    block = next(body for body in list_item_blocks(page, "bash") if "experiment=grpo model=qwen3_0_6b" in body)
    stated = next(body for body in list_item_blocks(page, "text") if "Generating" in body)
    for name in ("train.py", "conf"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**isolated_env(home), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    drawn, fits, predicted = stated.splitlines()
    assert drawn in result.stdout.splitlines() and fits in result.stdout.splitlines()
    generating = re.search(r"Of the step, generating takes .*", predicted).group(0)
    assert generating in result.stdout


def list_item_blocks(page: str, language: str) -> list[str]:
    """The fenced blocks of ``language`` inside a list item of ``page`` (indented), dedented."""
    return [textwrap.dedent(body) for _, body in re.findall(rf"^( +)```{language}\n(.*?)^\1```$", page, re.S | re.M)]
