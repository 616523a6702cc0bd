"""Online RL with rewards a program checks: GRPO (``experiment=grpo``, ``data=prompts``), TRL's ``GRPOTrainer``'s
loss, defaults and metric names (its arithmetic: ``project.tasks.group_relative``; the reward functions:
``project.tasks.rewards``).

Each step, for each prompt of the batch, the policy as it stands draws ``num_generations`` completions (its group;
``project.models.generation.sample_group``, in evaluation mode, no gradient, over a key/value cache, FSDP's units
gathered once for all the step's draws); the reward functions score them; the scores of the whole step are gathered
from every rank (one small collective a step; a tensor-parallel group's, drawn together, kept once), so every rank
computes the same advantages and metrics, the single-device loop's; then the policy's forward and backward run on
the prompts with their completions, the loss on the completions' tokens alone.

A prompt's draws come from a generator seeded with the data seed, the split, the epoch and the prompt's index in the
file: the same completions whatever the layout, the device count or a resume from a checkpoint (nothing to save).

Where ours differs from TRL's (``conf/experiment/grpo.yaml`` says so too): ``data.batch_size`` counts prompts per
replica (TRL's ``per_device_train_batch_size`` counts completions); the completions are drawn for each batch, so
under gradient accumulation ``dapo`` divides by each accumulated batch's tokens (TRL by the whole step's, drawn at
once); the per-token metrics (``entropy``, ``kl``, ``clip_ratio/*``) are the epoch's means over its tokens (TRL's:
the mean of each logged step's), kept as sums on each rank and reduced once an epoch.
"""

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal, cast

import torch
from torch import nn

from project.data.datamodule import DataModule, DataShape, split_index_column, trainer_data
from project.data.prompts import PromptDataModule
from project.data.sampling import data_parallel_rank_and_size
from project.data.targets import IGNORE_INDEX
from project.data.templated import token_rows
from project.job.job import Job
from project.job.task import Generation, Loss, MetricSums
from project.layouts.sharded_layout import ShardedLayout
from project.models.generation import sample_group
from project.models.lora import LoRALinear
from project.observability.loggers import EpochWandbLogger
from project.options.errors import ConfigError
from project.options.option_types import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from project.parallel.local_tensors import local_tensor
from project.parallel.parallelize import gathered_throughout
from project.tasks.group_relative import (
    PolicyLoss,
    completion_rewards,
    entropy,
    group_advantages,
    nan_std,
    token_log_probs,
)
from project.tasks.language_model import LanguageModelModule
from project.tasks.metrics import SampleMean
from project.tasks.rewards import KEY as REWARDS_KEY
from project.tasks.rewards import RewardFailed, RewardFunction, load_reward_function


@dataclass(frozen=True)
class GRPOSettings:
    """``model.grpo``: the sampling (``num_generations`` per prompt, ``temperature``, ``top_k`` (0: all), ``top_p``,
    ``max_completion_length``), the rewards (``reward_functions``, ``reward_weights``: None, 1 each), and the loss
    (``project.tasks.group_relative``). TRL's ``GRPOConfig`` names and defaults."""

    reward_functions: Sequence[str]
    reward_weights: Sequence[float] | None = None
    num_generations: PositiveInt = 8
    temperature: PositiveFloat = 1.0
    top_k: NonNegativeInt = 0
    top_p: PositiveFloat = 1.0
    max_completion_length: PositiveInt = 256
    epsilon: PositiveFloat = 0.2
    epsilon_high: PositiveFloat | None = None
    beta: NonNegativeFloat = 0.0
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"

    def __post_init__(self) -> None:
        if self.top_p > 1:
            raise ConfigError("model.grpo.top_p", f"is {self.top_p}, above 1.", "set a share in (0, 1]; 1 keeps all.")
        if not self.reward_functions:
            raise ConfigError(
                REWARDS_KEY, "is empty: GRPO learns from rewards.", "list file.py:name or module.name functions."
            )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_functions):
            raise ConfigError(
                "model.grpo.reward_weights",
                f"has {len(self.reward_weights)} weights for {len(self.reward_functions)} reward functions.",
                "give one weight per function, or null for 1 each.",
            )

    @property
    def policy_loss(self) -> PolicyLoss:
        return PolicyLoss(self.epsilon, self.epsilon_high, self.beta, self.loss_type, self.max_completion_length)


@dataclass(frozen=True)
class Rollout:
    """A batch's completions, scored: the rows the policy trains on (each prompt and one of its completions, padded
    at the end; targets the completion's tokens, ``IGNORE_INDEX`` elsewhere), each row's advantage, the reference's
    log-probabilities (beta > 0) and what ``dapo`` divides by."""

    inputs: torch.Tensor
    targets: torch.Tensor
    advantages: torch.Tensor
    reference: torch.Tensor | None
    step_tokens_per_rank: torch.Tensor
    sums: MetricSums  # the step's reward and length metrics
    shown: list[dict[str, object]]  # this rank's prompts, completions and rewards, as the W&B table shows them


REWARD_METRICS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
)
TOKEN_METRICS = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


class GRPOModule(LanguageModelModule):
    """The language model trained by GRPO on its own completions (module docstring). A batch is the prompts' padded
    tokens and (token count, file index) per prompt (``project.data.prompts``); ``loss`` reads the rows of the batch's
    ``Rollout``, whose index each target row carries as its last column."""

    progress_bar_metrics = ("loss", "reward")
    logs_perplexity = False  # the loss is not a token loss

    def __init__(self, net, grpo: GRPOSettings, **kwargs) -> None:
        super().__init__(net, **kwargs)
        if self.fused_loss:
            raise ConfigError(
                "model.fused_loss",
                "is true, but GRPO needs each completion token's log-probability, and the fused loss sums them.",
                "set model.fused_loss=false.",
            )
        self.grpo = grpo
        self.policy_loss = grpo.policy_loss
        self.reward_functions: list[RewardFunction] = [load_reward_function(spec) for spec in grpo.reward_functions]
        self.reward_weights = torch.tensor(grpo.reward_weights or [1.0] * len(self.reward_functions))
        # The KL term's reference: with LoRA the base (every adapter off); with full weights the initial weights, a
        # copy of this rank's share kept when they are placed (``keep_initial_weights``).
        self.adapters = [module for module in net.modules() if isinstance(module, LoRALinear)]
        self.reference_weights: list[torch.Tensor] = []
        names = [*REWARD_METRICS, *TOKEN_METRICS, "loss"]
        names += [f"rewards/{function.name}/{kind}" for function in self.reward_functions for kind in ("mean", "std")]
        names += ["kl"] if grpo.beta else []
        self.train_metrics = nn.ModuleDict({name: SampleMean() for name in names})
        self.val_metrics = nn.ModuleDict({name: SampleMean() for name in names})
        self.rollout: Rollout | None = None  # the batch under way's
        # The W&B table "completions": the first validation batch's completions of each epoch, rank 0's.
        self.completion_rows: list[dict[str, object]] = []

    # The step

    def _step(self, split: str, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        prompts, target = batch
        self.rollout = self._roll_out(split, prompts, target)
        rows = torch.arange(len(self.rollout.inputs), device=prompts.device)
        targets = torch.cat([self.rollout.targets, rows[:, None]], 1)
        loss = self.loss(self.net(self.rollout.inputs), targets)
        self.meter(split, loss)
        self.log_metrics(split)
        return loss.value

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._step("val", batch)
        if batch_idx == 0 and not self.trainer.sanity_checking and self.trainer.is_global_zero:
            assert self.rollout is not None
            self.completion_rows += [{"epoch": self.current_epoch, **row} for row in self.rollout.shown]

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        for logger in self.loggers:
            if isinstance(logger, EpochWandbLogger) and self.completion_rows:
                logger.log_summary_table("completions", self.completion_rows)

    def loss(self, outputs: torch.Tensor, target: torch.Tensor) -> Loss:
        """The policy loss of the logits ``outputs`` of the rollout's rows (the target's last column: their indices
        into it; with no rollout, the memory plan's simulated step, advantages of 0)."""
        target, rows = split_index_column(target)
        log_probs = token_log_probs(outputs, target, self.grpo.temperature)
        mask = target != IGNORE_INDEX
        rollout = self.rollout
        if rollout is None:
            advantages, tokens = torch.zeros(len(target), device=outputs.device), mask.sum()
            reference = torch.zeros_like(log_probs) if self.grpo.beta else None
        else:
            advantages, tokens = rollout.advantages[rows], rollout.step_tokens_per_rank
            reference = None if rollout.reference is None else rollout.reference[rows]
        value, terms = self.policy_loss(log_probs, mask, advantages, reference, tokens)

        def metric_sums() -> MetricSums:
            count = mask.sum()
            sums: MetricSums = dict(rollout.sums) if rollout is not None else {}
            sums["loss"] = (value.detach(), 1)
            sums["entropy"] = ((entropy(outputs / self.grpo.temperature) * mask).sum(), count)
            sums["clip_ratio/low_mean"] = (terms.low_clipped.sum(), count)
            sums["clip_ratio/high_mean"] = (terms.high_clipped.sum(), count)
            sums["clip_ratio/region_mean"] = ((terms.low_clipped + terms.high_clipped).sum(), count)
            if terms.kl is not None:
                sums["kl"] = (terms.kl.sum(), count)
            return sums

        return Loss(value, metric_sums)

    def _roll_out(self, split: str, prompts: torch.Tensor, target: torch.Tensor) -> Rollout:
        """Draw each prompt's group, score it, and lay out the rows the policy trains on (module docstring)."""
        data = cast(PromptDataModule, trainer_data(self.trainer))
        grpo = self.grpo
        tokenizer = data.renderer.tokenizer
        stop = data.stop_tokens
        rows, completions, prompts_given, columns, lengths = [], [], [], [], []
        with self._generating():
            for prompt, (length, index) in zip(prompts, target.tolist(), strict=True):
                generator = torch.Generator().manual_seed(self._seed(split, index))
                drawn, ends = sample_group(
                    self.net,
                    prompt[:length],
                    grpo.num_generations,
                    grpo.max_completion_length,
                    generator,
                    stop,
                    grpo.temperature,
                    grpo.top_k,
                    grpo.top_p,
                )
                _, given, record = data.prompt_at(index)
                for completion, end in zip(drawn, ends.tolist(), strict=True):
                    ids = completion[:end].tolist()
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                    rows.append((prompt[:length].tolist(), ids))
                    completions.append(text if isinstance(given, str) else [{"role": "assistant", "content": text}])
                    prompts_given.append(given)
                    columns.append(record)
                    lengths.append(end)
        scores = self._scores(prompts_given, completions, [ids for _, ids in rows], columns)
        # Cut at the limit: as long as it allows, and not ended by a stop token.
        clipped = [len(ids) == grpo.max_completion_length and ids[-1] not in stop for _, ids in rows]
        replica, replicas = data_parallel_rank_and_size(self.trainer)
        figures = [lengths, clipped, [replica] * len(rows)]
        local = torch.cat([scores, torch.tensor(figures, dtype=scores.dtype).T], 1)
        # Every rank's: (ranks, completions, functions + 3). The ranks of a tensor-parallel group draw the same
        # completions of the same prompts: each replica's are kept once, in replica order.
        ranks = cast(torch.Tensor, self.all_gather(local.to(self.device))).reshape(-1, *local.shape).cpu()
        first = [int((ranks[:, 0, -1] == index).nonzero()[0]) for index in range(replicas)]
        everyone = ranks[first].reshape(-1, local.shape[1])
        all_scores, all_lengths, all_clipped = everyone[:, :-3], everyone[:, -3], everyone[:, -2]
        rewards = completion_rewards(all_scores, self.reward_weights)
        advantages, zero_std = group_advantages(rewards, grpo.num_generations, grpo.scale_rewards)
        mine = slice(replica * len(local), (replica + 1) * len(local))
        # Each prompt and one of its completions, the completion's tokens trained, padded to the longest.
        sequences = [(prompt + ids, [False] * len(prompt) + [True] * len(ids)) for prompt, ids in rows]
        inputs, targets = token_rows(sequences, max(len(ids) for ids, _ in sequences) - 1)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        reference = self._reference(inputs, targets) if grpo.beta else None
        sums = _reward_sums(self.reward_functions, all_scores, rewards, zero_std, all_lengths, all_clipped)
        shown = [
            {
                "prompt": given if isinstance(given, str) else given[-1]["content"],
                "completion": completion if isinstance(completion, str) else completion[0]["content"],
                "reward": float(reward),
                "advantage": float(advantage),
            }
            for given, completion, reward, advantage in zip(
                prompts_given, completions, rewards[mine], advantages[mine], strict=True
            )
        ]
        return Rollout(
            inputs,
            targets,
            advantages[mine].to(self.device, torch.float32),
            reference,
            torch.tensor(float(all_lengths.sum()) / replicas, device=self.device),
            sums,
            shown,
        )

    def _scores(self, prompts: list, completions: list, completion_ids: list, records: list[dict]) -> torch.Tensor:
        """(completions, functions) scores, NaN where a function gave None; columns as TRL hands them: the first
        record's keys, a list each."""
        columns = {key: [record.get(key) for record in records] for key in records[0]} if records else {}
        scores = [function.scores(prompts, completions, completion_ids, columns) for function in self.reward_functions]
        # float64: the advantages divide differences of rewards by their spread; rounded to float32 once, at the end
        return torch.tensor(scores, dtype=torch.float64).T.reshape(len(completions), len(self.reward_functions))

    def _seed(self, split: str, index: int) -> int:
        """The seed of a prompt's draws this epoch (module docstring)."""
        data = trainer_data(self.trainer)
        key = f"{data.seed}:{split}:{self.current_epoch}:{index}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1

    @contextlib.contextmanager
    def _evaluating(self) -> Iterator[None]:
        """The net in evaluation mode (dropout off), no gradient."""
        training = self.net.training
        self.net.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.net.train(training)

    @contextlib.contextmanager
    def _generating(self) -> Iterator[None]:
        """As ``_evaluating``, FSDP's units gathered throughout, and compiled blocks run eagerly (a pass of one token
        a row, over a cache that grows each token, would compile anew)."""
        with self._evaluating(), gathered_throughout(self.net), torch.compiler.set_stance("force_eager"):
            yield

    def keep_initial_weights(self) -> list[torch.Tensor]:
        """With ``beta`` > 0 and full weights, a copy of this rank's share of every parameter as it starts: the KL
        term's reference. (Not in the checkpoint: a resumed run's ``configure_model`` makes the same weights.)"""
        if self.grpo.beta and not self.adapters:
            self.reference_weights = [local_tensor(parameter).detach().clone() for parameter in self.net.parameters()]
        return self.reference_weights

    def _reference(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The reference's log-probabilities of the rows, FSDP's units gathered for the pass (so none keeps the
        reference's values gathered after it)."""
        with self._evaluating(), self._as_reference(), gathered_throughout(self.net):
            return token_log_probs(self.net(inputs), targets, self.grpo.temperature)

    @contextlib.contextmanager
    def _as_reference(self) -> Iterator[None]:
        """Inside, the net is the reference: with LoRA every adapter off; with full weights each parameter holds
        its initial value, exchanged in place with the kept copy (one parameter's worth of memory at a time, where
        FSDP's and tensor parallelism's collectives read the shards), and exchanged back on the way out, what the
        model options derive from the weights (Float8's gathered scales) made again each time."""
        scalings = [module.scaling for module in self.adapters]
        parameters = [local_tensor(parameter) for parameter in self.net.parameters()] if self.reference_weights else []
        exchanged = 0
        try:
            for module in self.adapters:
                module.scaling = 0.0
            self._kept_as_parameters()
            for parameter, kept in zip(parameters, self.reference_weights, strict=True):
                _exchange(parameter, kept)
                exchanged += 1
            if parameters:
                self.after_weights_change()
            yield
        finally:
            for parameter, kept in zip(parameters[:exchanged], self.reference_weights, strict=False):
                _exchange(parameter, kept)
            if exchanged:
                self.after_weights_change()
            for module, scaling in zip(self.adapters, scalings, strict=True):
                module.scaling = scaling

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self._kept_as_parameters()

    def _kept_as_parameters(self) -> None:
        """The kept copy in the parameters' dtypes: Lightning's true half precisions convert the model after
        ``configure_model`` (the same values, rounded as the model's were)."""
        parameters = [local_tensor(parameter) for parameter in self.net.parameters()] if self.reference_weights else []
        self.reference_weights = [
            kept.to(parameter.dtype) for kept, parameter in zip(self.reference_weights, parameters, strict=True)
        ]

    # The plan

    def step_shape(self, shape: DataShape) -> DataShape:
        """A batch's prompts become ``num_generations`` rows each, a prompt with one completion, of at most
        ``data.seq_length`` tokens (padded to the longest)."""
        return replace(shape, sequences_per_sample=self.grpo.num_generations)

    def generation(self, shape: DataShape) -> Generation:
        """Each prompt's group, the prompt at its longest (``data.seq_length`` + 1 less a whole completion)."""
        assert shape.seq_length is not None, "prompts are token data"
        length = self.grpo.max_completion_length
        return Generation(self.grpo.num_generations, shape.seq_length + 1 - length, length, bool(self.grpo.beta))

    # The rules

    def problem(self, job: Job) -> ConfigError | None:
        """The draws run the whole net on each rank, or on each tensor-parallel group together: not split in
        stages (a pipeline's ranks, model_parallel's devices). Under tensor parallelism each pass's sequence and
        logits stay whole: one token a pass cannot be split by position, and each draw reads the last position's
        whole logits."""
        dims = job.dims
        if dims.pipelined or job.processes_per_node < job.devices:  # a pipeline; a process driving several stages
            return ConfigError(
                "strategy",
                f"is {job.strategy_name}, whose ranks or devices hold stages of the model; GRPO draws completions "
                "with every block on each rank (or each tensor-parallel group), which is not built across stages.",
                "use strategy=auto, ddp, fsdp or tensor_parallel.",
            )
        split = job.layout.tensor_parallel if isinstance(job.layout, ShardedLayout) else None
        if dims.tensor_parallel > 1 and split is not None and (split.sequence_parallel or split.loss_parallel):
            key = "strategy.sequence_parallel" if split.sequence_parallel else "strategy.loss_parallel"
            return ConfigError(
                key,
                "is true, but GRPO's one-token passes cannot split their sequence between the tensor-parallel "
                "ranks, and each draw reads the last position's logits whole.",
                "set strategy.sequence_parallel=false strategy.loss_parallel=false.",
            )
        return super().problem(job)

    def data_problem(self, data: DataModule, ckpt_path: str | None, evaluating: bool) -> ConfigError | None:
        """GRPO trains on prompts, each leaving room for a whole completion within the sequence."""
        if not isinstance(data, PromptDataModule):
            return ConfigError(
                "data",
                f"is {type(data).__name__}, but experiment=grpo trains on prompts.",
                'use data=prompts data.path=<a .jsonl of {"prompt": ...}> (experiment=grpo sets it).',
            )
        problem = self._reward_problem(data)
        if problem is not None:
            return problem
        longest, where = data.longest_prompt
        room = data.seq_length + 1 - longest
        if room < self.grpo.max_completion_length:
            return ConfigError(
                "model.grpo.max_completion_length",
                f"is {self.grpo.max_completion_length}, but {where}'s prompt of {longest} tokens leaves {room} "
                f"within data.seq_length + 1 = {data.seq_length + 1}.",
                f"raise data.seq_length to {longest + self.grpo.max_completion_length - 1}, or lower "
                "model.grpo.max_completion_length, or shorten that prompt.",
            )
        return None

    def _reward_problem(self, data: PromptDataModule) -> ConfigError | None:
        """Each reward function called once, on the first prompt with an empty completion, as training calls it:
        one that raises or breaks the contract is refused before launch, naming it."""
        where, given, record = data.prompt_at(0)
        completion = "" if isinstance(given, str) else [{"role": "assistant", "content": ""}]
        columns = {key: [value] for key, value in record.items()}
        for function in self.reward_functions:
            try:
                function.scores([given], [completion], [[]], columns)
            except RewardFailed as failure:
                return ConfigError(
                    REWARDS_KEY,
                    f"{function.spec} {failure.problem}, when called before launch on {where}'s prompt and an empty "
                    "completion.",
                    "fix the function: it takes prompts, completions and completion_ids (and the line's other keys) "
                    "by name, and returns one number (or None) per completion, as TRL's reward functions do.",
                )
        return None


@torch.no_grad()
def _exchange(this: torch.Tensor, that: torch.Tensor) -> None:
    """Swap the values of two tensors of one shape and dtype, in place."""
    held = this.clone()
    this.copy_(that)
    that.copy_(held)


def _reward_sums(
    functions: list[RewardFunction],
    scores: torch.Tensor,
    rewards: torch.Tensor,
    zero_std: torch.Tensor,
    lengths: torch.Tensor,
    clipped: torch.Tensor,
) -> MetricSums:
    """The step's reward and length metrics, of every replica's completions (the same on every rank: each rank
    adds them, and their sum over ranks keeps each ratio). A standard deviation is one value a step (TRL's)."""
    scored = ~rewards.isnan()
    sums: MetricSums = {
        "reward": (rewards.nansum().double(), int(scored.sum())),
        "reward_std": (nan_std(rewards).nan_to_num(0.0).double(), 1),
        "frac_reward_zero_std": (zero_std.double().sum(), len(zero_std)),
        "completions/mean_length": (lengths.double().sum(), len(lengths)),
        "completions/clipped_ratio": (clipped.double().sum(), len(clipped)),
    }
    for column, function in enumerate(functions):
        given = scores[:, column]
        sums[f"rewards/{function.name}/mean"] = (given.nansum().double(), int((~given.isnan()).sum()))
        sums[f"rewards/{function.name}/std"] = (nan_std(given).nan_to_num(0.0).double(), 1)
    return sums
