"""Preference tuning (project/tasks/dpo.py, project/data/preference.py): the loss against TRL's own and the
formula by hand; pairs tokenized with only their responses trained; every strategy against a hand-written DPO loop,
whose reference is a frozen copy of the model run at every step; LoRA's reference the base's; a resumed run the
straight run's, and mode=eval of a checkpoint its run's last validation; the memory plan holding no second copy of
the model."""

import copy
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from conftest import only_run, run_command, train, two_job_sweep
from helpers.reference import build_optimizer, epoch_order, lr_factor
from hydra.utils import instantiate
from omegaconf import DictConfig

from project.cli.chat_example import write_example
from project.data.preference import PreferenceDataModule
from project.models import init_weights
from project.options.errors import ConfigError
from project.tasks.dpo import PAIR_METRICS, REFERENCE_KEY, PreferenceLoss

IGNORED = -100
NET = ["model.net.dim=32", "model.net.num_heads=2", "model.net.num_kv_heads=2", "model.net.hidden_dim=64"]
DPO_OVERRIDES = [
    "experiment=dpo",
    "model=qwen3",
    *NET,
    "data.seq_length=32",
    "data.batch_size=8",
    "model.optimizer.lr=0.003",
    "model.dpo.beta=0.5",
    "model.dpo.sft_weight=0.2",
    "trainer.max_epochs=2",
    "trainer.accumulate_grad_batches=2",
    "print_config=false",
    "~callbacks.progress_bar",
    "+trainer.enable_progress_bar=false",
]
PAIR_KEYS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@pytest.fixture(scope="session")
def preference_example(shared_tmp) -> tuple[Path, Path]:
    """``python -m project.cli.chat_example``'s tiny Qwen 3 dir and its 128 preference pairs ("Ahoy" over "Hello")."""
    out = shared_tmp / "preference-example"
    if not (out / "preference.jsonl").is_file():
        write_example(out, count=128)
    return out / "model", out / "preference.jsonl"


def per_token_log_probs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """log softmax at each target, 0 where it is ignored: from the definition, not through cross_entropy."""
    picked = logits.log_softmax(-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * (target != IGNORED)


# The loss


def trl_loss(
    losses: dict[str, float], beta: float, per_token: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor
):
    """TRL's ``DPOTrainer._compute_loss`` (TRL 1.16) on the per-token log-probabilities ``per_token`` of a batch laid
    out as TRL lays it, chosen rows then rejected rows, with precomputed reference log-probabilities: its loss and
    the metrics it records. The model is a stand-in that returns those log-probabilities (TRL's fused head's
    outputs), and the trainer only the attributes the method reads. ``losses``: TRL's loss types and their weights."""
    from trl.trainer.dpo_trainer import DPOTrainer

    rows, length = per_token.shape
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=list(losses),
        loss_weights=list(losses.values()),
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    outputs = SimpleNamespace(
        log_probs=per_token,
        entropy=torch.zeros(rows, length),
        mean_logits=torch.zeros(rows, length),
        is_top1=torch.zeros(rows, length, dtype=torch.bool),
    )
    completion_mask = torch.cat([torch.zeros(rows, 1, dtype=torch.long), mask.long()], dim=1)  # TRL shifts it
    inputs = {
        "input_ids": torch.zeros(rows, length + 1, dtype=torch.long),
        "attention_mask": torch.ones(rows, length + 1, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": reference[:, 0],
        "ref_rejected_logps": reference[:, 1],
    }
    loss = DPOTrainer._compute_loss(trainer, lambda **kwargs: outputs, inputs, return_outputs=False)
    return loss, {key: values[-1] for key, values in trainer._metrics["train"].items()}


@pytest.mark.parametrize(
    "loss_type, sft_weight", [("sigmoid", 0.0), ("ipo", 0.0), ("sigmoid", 0.7)], ids=["sigmoid", "ipo", "sigmoid+sft"]
)
def test_the_loss_its_gradient_and_rewards_are_trls(loss_type, sft_weight):
    """Pairs of responses of different lengths: the loss, its gradient with respect to the logits, and the mean
    rewards, margins and accuracies, as TRL's DPO trainer computes them from the same log-probabilities. With an
    SFT term (TRL's loss types [sigmoid, sft] weighted [1, sft_weight]): TRL takes the chosen tokens' mean over the
    batch, this project each chosen response's mean (RPO's), the same here where the chosen are equally long."""
    pytest.importorskip("trl")
    torch.manual_seed(0)
    pairs, length, vocab, beta = 6, 7, 11, 0.3
    logits = torch.randn(pairs, 2, length, vocab, dtype=torch.float64, requires_grad=True)
    target = torch.randint(vocab, (pairs, 2, length))
    target[:, :, :2] = IGNORED  # the prompt
    target[torch.arange(pairs), 1, torch.arange(pairs) % 3 + 4] = IGNORED  # padding: rejected shorter by a token
    reference = -torch.rand(pairs, 2, dtype=torch.float64) * 20

    per_token = per_token_log_probs(logits, target)  # (pairs, 2, length)
    trl_rows = torch.cat([per_token[:, 0], per_token[:, 1]])  # TRL's batch: the chosen, then the rejected
    trl_mask = torch.cat([target[:, 0], target[:, 1]]) != IGNORED
    trl_losses = {loss_type: 1.0, **({"sft": sft_weight} if sft_weight else {})}
    expected, metrics = trl_loss(trl_losses, beta, trl_rows, reference, trl_mask)
    (expected_grad,) = torch.autograd.grad(expected, logits, retain_graph=True)  # per_token serves both

    loss = PreferenceLoss(beta, loss_type, sft_weight)
    losses, rewards = loss(per_token.sum(-1), reference, (target != IGNORED).sum(-1))
    (grad,) = torch.autograd.grad(losses.mean(), logits)
    assert losses.mean().item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)
    assert rewards[:, 0].mean().item() == pytest.approx(metrics["rewards/chosen"], rel=1e-6)
    assert rewards[:, 1].mean().item() == pytest.approx(metrics["rewards/rejected"], rel=1e-6)
    assert (rewards[:, 0] - rewards[:, 1]).mean().item() == pytest.approx(metrics["rewards/margins"], rel=1e-6)
    assert (rewards[:, 0] > rewards[:, 1]).double().mean().item() == pytest.approx(metrics["rewards/accuracies"])


def test_the_loss_by_hand():
    """One pair, the papers' formulas in plain floats: DPO's -log sigmoid(beta x ((c - c_ref) - (r - r_ref))) and its
    derivative -beta sigmoid(-beta x delta) with respect to the chosen log-probability; IPO's squared distance of the
    per-token log-ratio difference from 1 / (2 beta)."""
    chosen, rejected, chosen_ref, rejected_ref, beta = -12.0, -15.0, -13.5, -14.0, 0.2
    tokens = torch.tensor([[4, 6]])
    delta = (chosen - chosen_ref) - (rejected - rejected_ref)
    policy = torch.tensor([[chosen, rejected]], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([[chosen_ref, rejected_ref]], dtype=torch.float64)

    losses, rewards = PreferenceLoss(beta, "sigmoid")(policy, reference, tokens)
    assert losses.item() == pytest.approx(-math.log(1 / (1 + math.exp(-beta * delta))), rel=1e-12)
    (grad,) = torch.autograd.grad(losses.sum(), policy)
    sigmoid = 1 / (1 + math.exp(beta * delta))
    assert grad[0].tolist() == pytest.approx([-beta * sigmoid, beta * sigmoid], rel=1e-12)
    assert rewards[0].tolist() == pytest.approx([beta * (chosen - chosen_ref), beta * (rejected - rejected_ref)])

    losses, _ = PreferenceLoss(beta, "ipo")(policy, reference, tokens)
    per_token_delta = (chosen - chosen_ref) / 4 - (rejected - rejected_ref) / 6
    assert losses.item() == pytest.approx((per_token_delta - 1 / (2 * beta)) ** 2, rel=1e-12)

    with_sft, _ = PreferenceLoss(beta, "sigmoid", sft_weight=0.2)(policy, reference, tokens)
    assert with_sft.item() == pytest.approx(-math.log(1 / (1 + math.exp(-beta * delta))) + 0.2 * 12.0 / 4, rel=1e-12)


def test_a_sweeps_objective_does_not_scale_with_beta():
    """experiment=dpo's sweep objective is the validation pairs' reward accuracy: whether a pair's chosen reward beats
    its rejected one is the sign of delta whatever beta, where the loss (what best_metric keeps, within a run of one
    beta) moves with beta at the same log-probabilities."""
    from test_config import compose_train

    cfg = compose_train(["experiment=dpo"])
    assert (cfg.optimized_metric.name, cfg.optimized_metric.mode) == ("val/rewards/accuracies", "max")
    policy = torch.randn(64, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    reference, tokens = torch.zeros_like(policy), torch.full((64, 2), 5)
    outcomes = [PreferenceLoss(beta, "sigmoid")(policy, reference, tokens) for beta in (0.05, 0.5)]
    (low_losses, low_rewards), (high_losses, high_rewards) = outcomes
    assert torch.equal(low_rewards[:, 0] > low_rewards[:, 1], high_rewards[:, 0] > high_rewards[:, 1])
    assert abs(low_losses.mean() - high_losses.mean()) > 0.1


# The data


def test_a_pair_trains_its_responses_tokens_only(preference_example, tmp_path):
    """A conversational pair whose prompt holds an earlier assistant turn, the same responses as text after a prompt
    as text, and after a one-turn prompt as messages: each row's trained targets decode to its own response and its
    end (the template's end of turn; as text, TRL's end-of-sequence token, no template), the prompt's assistant turn
    untrained. (Text was rendered with the template, as the third pair is, until TRL's tokenization was matched.)"""
    model_dir, _ = preference_example
    ask, earlier = [{"role": "user", "content": "Please greet Ada."}], {"role": "assistant", "content": "Hello, Ada!"}
    chosen, rejected = "Ahoy, Alan! Welcome aboard.", "Hello, Alan! Nice to meet you."
    records = [
        {
            "prompt": [*ask, earlier, {"role": "user", "content": "And Alan?"}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        },
        {"prompt": "Greet Alan.", "chosen": chosen, "rejected": rejected},
        {"prompt": [{"role": "user", "content": "Greet Alan."}], "chosen": chosen, "rejected": rejected},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    data = PreferenceDataModule(str(path), str(model_dir), seq_length=48, val_fraction=0.34, batch_size=1, seed=0)
    codec = data.text_codec()
    for pair, end in enumerate(("<|im_end|>\n", "<|im_end|>", "<|im_end|>\n")):  # the example's eos: <|im_end|>
        for column, response in enumerate((chosen, rejected)):
            target = data.targets[pair, column]
            assert codec.decode(target[target != IGNORED].tolist()) == response + end
    prompt_as_text = codec.decode(data.inputs[1, 0, :4].tolist())
    assert prompt_as_text.startswith("Greet Alan.") and "<|im_start|>" not in prompt_as_text
    assert "3 pairs" in data.summary and "0 of their 6 responses cut" in data.summary
    short = PreferenceDataModule(str(path), str(model_dir), seq_length=36, val_fraction=0.34, batch_size=1, seed=0)
    assert "2 of their 6 responses cut to 37 tokens" in short.summary  # the long prompt's pair, kept from its start
    assert torch.equal(short.targets[0], data.targets[0, :, :36])


def test_a_response_not_the_assistants_and_a_file_of_no_pairs_are_refused(preference_example, tmp_path):
    model_dir, _ = preference_example
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "Hi", "chosen": [{"role": "user", "content": "Hi"}], "rejected": "Yo"}))
    with pytest.raises(ConfigError, match=rf"data.path: {path}:1: has a user message in its chosen response"):
        PreferenceDataModule(str(path), str(model_dir), seq_length=32, val_fraction=0.5, batch_size=1, seed=0)
    path.write_text("\n\n")
    with pytest.raises(ConfigError, match=rf"data.path: {path} holds no pair"):
        PreferenceDataModule(str(path), str(model_dir), seq_length=32, val_fraction=0.5, batch_size=1, seed=0)


@pytest.mark.parametrize("warmup", [0, 3])
def test_the_linear_schedule_is_transformers(warmup):
    """experiment=dpo's schedule (TRL's lr_scheduler_type=linear) gives transformers' learning rate at every step,
    past the run's end included."""
    from transformers import get_linear_schedule_with_warmup

    from project.tasks.schedules import warmup_linear

    ours, theirs = (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5) for _ in range(2))
    schedules = warmup_linear(ours, 10, warmup_steps=warmup), get_linear_schedule_with_warmup(theirs, warmup, 10)
    for _ in range(12):
        assert ours.param_groups[0]["lr"] == pytest.approx(theirs.param_groups[0]["lr"], abs=1e-12)
        for schedule in schedules:
            schedule.step()


def _pairs_in_trls_formats(eos: str) -> dict[str, list[dict]]:
    """Pairs in TRL's standard (text) and conversational (messages) formats, with the cases that tell tokenizations
    apart: a response that already ends with the end-of-sequence token, a token merging across the prompt's end, a
    prompt holding an earlier assistant turn, a response of two assistant messages."""

    def user(text: str) -> list[dict]:
        return [{"role": "user", "content": text}]

    def assistant(*texts: str) -> list[dict]:
        return [{"role": "assistant", "content": text} for text in texts]

    return {
        "text": [
            {"prompt": "Say hello.", "chosen": " Ahoy there!", "rejected": " Hello."},
            {"prompt": "Greet me:", "chosen": "Ahoy" + eos, "rejected": "Hi"},  # its own end: not appended twice
            {"prompt": "Hello", "chosen": "Ahoy", "rejected": "Hello"},
            {"prompt": "A sailor says", "chosen": " ahoy", "rejected": " hello"},
        ],
        "messages": [
            {"prompt": user("Say hello."), "chosen": assistant("Ahoy there!"), "rejected": assistant("Hello.")},
            {
                "prompt": [*user("Greet Ada."), *assistant("Hello, Ada!"), *user("And Alan?")],
                "chosen": assistant("Ahoy, Alan!"),
                "rejected": assistant("Hello."),
            },
            {"prompt": user("Greet two."), "chosen": assistant("Ahoy!", "Ahoy again!"), "rejected": assistant("Hi.")},
            {"prompt": user("Count."), "chosen": assistant("One."), "rejected": assistant("One,", "two.")},
        ],
    }


@pytest.mark.parametrize("form", ["text", "messages"])
def test_pairs_are_tokenized_as_trl_tokenizes_them(preference_example, tmp_path, form):
    """TRL's standard (``{"prompt": "...", "chosen": "...", "rejected": "..."}``) and conversational formats: each
    sequence's tokens and trained tokens are those TRL 1.16's ``DPOTrainer`` makes of it (its own dataset
    preparation, with transformers' tokenizer of the model dir). Text: as it is, no chat template, the
    end-of-sequence token appended. Messages: the chat template, everything after the prompt trained, the header
    between a response's two messages too."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.trainer.dpo_trainer import DPOTrainer

    model_dir, _ = preference_example
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = _pairs_in_trls_formats(tokenizer.eos_token)[form]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    data = PreferenceDataModule(str(path), str(model_dir), seq_length=64, val_fraction=0.25, batch_size=1, seed=0)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    prepared = DPOTrainer._prepare_dataset(
        SimpleNamespace(_tokenizer=tokenizer), Dataset.from_list(pairs), tokenizer, args, "train"
    )
    for index, row in enumerate(prepared):
        for column, key in enumerate(("chosen_ids", "rejected_ids")):
            ids = row["prompt_ids"] + row[key]
            inputs, targets = data.inputs[index, column], data.targets[index, column, :-1]  # the last: the pair's index
            assert inputs[: len(ids) - 1].tolist() == ids[:-1]
            assert targets[targets != IGNORED].tolist() == row[key]
            if form == "text":
                assert row[key][-1] == tokenizer.eos_token_id


def test_pairs_whose_responses_are_the_same_are_said_to_teach_nothing(preference_example, tmp_path):
    """A pair whose chosen and rejected responses are equal has loss log 2 whatever the model does: legal, almost
    surely not meant, and said in the data's line."""
    model_dir, _ = preference_example
    path = tmp_path / "pairs.jsonl"
    same = {"prompt": "Hi", "chosen": "Hello there", "rejected": "Hello there"}
    path.write_text(json.dumps(same) + "\n" + json.dumps({**same, "rejected": "Go away"}) + "\n")
    data = PreferenceDataModule(str(path), str(model_dir), seq_length=32, val_fraction=0.5, batch_size=1, seed=0)
    assert "1 of the pairs have the same chosen and rejected response: their loss is log 2" in data.summary
    path.write_text(json.dumps({**same, "rejected": "Go away"}) + "\n" + json.dumps({**same, "chosen": "Hey"}) + "\n")
    data = PreferenceDataModule(str(path), str(model_dir), seq_length=32, val_fraction=0.5, batch_size=1, seed=0)
    assert "the same chosen and rejected" not in data.summary


# Every strategy against a hand-written DPO loop


def hand_written_dpo(cfg: DictConfig, global_batch: int) -> list[dict[str, float]]:
    """DPO as the paper writes it, in plain PyTorch: the reference a frozen copy of the initial model, run on every
    batch; a pair's log-probability the sum of its response tokens' log-softmax; RPO's term, the chosen response's
    mean token NLL x ``sft_weight``; the loss the global batch's mean over pairs, accumulated over
    ``trainer.accumulate_grad_batches`` batches; the metrics means over the epoch's pairs. The data's tensors (the
    tokenized pairs) and the model class come from the project."""
    data = instantiate(cfg.data)
    train_pairs = data.num_train_samples
    inputs, targets = data.inputs, data.targets
    net = init_weights(instantiate(cfg.model.net), cfg.seed)
    reference = copy.deepcopy(net).eval().requires_grad_(False)
    beta, sft_weight = cfg.model.dpo.beta, cfg.model.dpo.sft_weight
    accumulate, epochs = cfg.trainer.accumulate_grad_batches, cfg.trainer.max_epochs
    batches = train_pairs // global_batch
    optimizer = build_optimizer(cfg, net)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg, epochs * math.ceil(batches / accumulate)))

    def log_probs(model: torch.nn.Module, pairs: torch.Tensor) -> torch.Tensor:
        logits = model(inputs[pairs].flatten(0, 1))
        return per_token_log_probs(logits, targets[pairs].flatten(0, 1)).sum(-1).view(-1, 2)

    def pair_values(pairs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with torch.no_grad():
            chosen_ref, rejected_ref = log_probs(reference, pairs).unbind(-1)
        chosen, rejected = log_probs(net, pairs).unbind(-1)
        chosen_reward, rejected_reward = beta * (chosen - chosen_ref), beta * (rejected - rejected_ref)
        chosen_tokens = (targets[pairs, 0] != IGNORED).sum(-1)
        losses = -F.logsigmoid(chosen_reward - rejected_reward) - sft_weight * chosen / chosen_tokens
        return losses, {
            "loss": losses.detach(),
            "rewards/chosen": chosen_reward.detach(),
            "rewards/rejected": rejected_reward.detach(),
            "rewards/margins": (chosen_reward - rejected_reward).detach(),
            "rewards/accuracies": (chosen_reward > rejected_reward).double(),
            "logps/chosen": chosen.detach(),
            "logps/rejected": rejected.detach(),
        }

    history = []
    for epoch in range(epochs):
        order = epoch_order(train_pairs, cfg.seed, epoch)
        sums: dict[str, float] = defaultdict(float)
        for index in range(batches):
            losses, values = pair_values(order[index * global_batch : (index + 1) * global_batch])
            (losses.mean() / accumulate).backward()
            for key, value in values.items():
                sums[key] += value.double().sum().item()
            if (index + 1) % accumulate == 0 or index + 1 == batches:
                if cfg.trainer.gradient_clip_val:  # TRL's max_grad_norm, by the whole model's norm
                    torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.trainer.gradient_clip_val)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
        net.eval()
        with torch.no_grad():
            _, val_values = pair_values(torch.arange(train_pairs, len(inputs)))
        net.train()
        row = {f"train/{key}": total / (batches * global_batch) for key, total in sums.items()}
        row.update({f"val/{key}": value.double().mean().item() for key, value in val_values.items()})
        history.append(row)
    return history


@pytest.fixture(scope="session")
def dpo_runs(preference_example, runs_dir, home) -> dict[str, Path]:
    """The tiny Qwen 3 from seeded weights, DPO on the example's pairs: on one device (16 pairs a batch), and under
    ddp, fsdp (2 replicas of 8), tensor_parallel, model_parallel and pipeline (one replica of 8; the pipeline's
    4 micro-batches of 2 pairs, its last validation batch of 4 pairs padded to 8) over 2 devices."""
    model_dir, pairs = preference_example
    data = [f"data.path={pairs}", f"data.tokenizer={model_dir}"]
    strategies = "strategy=ddp,fsdp,tensor_parallel,model_parallel,pipeline"
    sweep = [*DPO_OVERRIDES, *data, "trainer.devices=2", strategies]
    sweep_dir = two_job_sweep("dpo", sweep, runs_dir, home)[1][0].parent
    single = runs_dir / "dpo-single"
    if not (single / "result.json").is_file():
        train([*DPO_OVERRIDES, *data, "data.batch_size=16", f"hydra.run.dir={single}"], home)
    names = ["ddp", "fsdp", "tp", "model_parallel", "pipeline"]
    return {"auto": single, **{name: sweep_dir / str(job) for job, name in enumerate(names)}}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto", "ddp", "fsdp", "tp", "model_parallel", "pipeline"])
def test_every_strategy_gives_the_hand_written_loops_numbers(dpo_runs, preference_example, strategy):
    """Each epoch's loss, rewards, margins and accuracies, training and validation, in the run's W&B history, equal
    the hand-written loop's to 1e-5; and DPO did its work: the chosen responses gained on the rejected ones."""
    from test_config import compose_train

    model_dir, pairs = preference_example
    global_batch = 16 if strategy in ("auto", "ddp", "fsdp") else 8  # one replica of 8: tp, model_parallel, pipeline
    cfg = compose_train([*DPO_OVERRIDES, f"data.path={pairs}", f"data.tokenizer={model_dir}"])
    expected = _hand_written(cfg, global_batch)
    run = only_run(dpo_runs[strategy])
    for key in expected[0]:
        assert run.series(key) == pytest.approx([row[key] for row in expected], rel=1e-5, abs=1e-6), key
    assert expected[-1]["val/rewards/margins"] > expected[0]["val/rewards/margins"] > 0
    assert expected[-1]["val/rewards/accuracies"] == 1.0


@pytest.mark.slow
def test_the_report_draws_each_of_dpos_metrics_per_epoch(dpo_runs, tmp_path, home):
    """``python -m project.cli.report`` of the DPO sweep: a chart for each metric DPO logs (its loss, rewards,
    margins, accuracies and log-probabilities, training and validation), a curve per job, a tick per epoch."""
    from test_report import render_report

    sweep_dir = dpo_runs["ddp"].parent
    charts = render_report(sweep_dir, tmp_path, [], home, screenshot=False)
    epochs = [str(row["epoch"]) for row in json.loads((dpo_runs["ddp"] / "result.json").read_text())["history"]]
    jobs = len([job for job in sweep_dir.iterdir() if (job / "result.json").is_file()])
    for name in PAIR_METRICS:
        for split in ("train", "val"):
            chart = f"curve-{split}-{name.replace('/', '-')}"
            assert len(charts.traces[chart]) == jobs and charts.xticks[chart] == epochs, chart


@pytest.mark.slow
def test_an_export_carries_the_pairs_tokenizer_and_template(dpo_runs, preference_example, tmp_path, home):
    """A run whose pairs were rendered with data.tokenizer's dir (no model.init_from) exports that dir's tokenizer
    and chat template beside the weights, as a data=chat run does."""
    model_dir, _ = preference_example
    checkpoint = dpo_runs["auto"] / "checkpoints" / "last.ckpt"
    result = run_command([sys.executable, "-m", "project.cli.export", str(checkpoint), str(tmp_path / "out")], home)
    assert result.returncode == 0, result.output[-3000:]
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (model_dir / name).read_bytes(), name


_HAND_WRITTEN: dict[int, list[dict[str, float]]] = {}


def _hand_written(cfg: DictConfig, global_batch: int) -> list[dict[str, float]]:
    if global_batch not in _HAND_WRITTEN:
        _HAND_WRITTEN[global_batch] = hand_written_dpo(cfg, global_batch)
    return _HAND_WRITTEN[global_batch]


# The reference, a resumed run, the plan


def lora_dpo_run(preference_example) -> list[str]:
    """DPO with LoRA adapters from the example's model dir (model.init_from), no learning-rate schedule (the same rate
    in a run of 1 epoch and one of 2)."""
    model_dir, pairs = preference_example
    return [
        *[item for item in DPO_OVERRIDES if not item.startswith("model.net.")],
        f"model.init_from={model_dir}",
        f"data.path={pairs}",
        "logger=csv",
        "model.scheduler=null",
        "model.lora.rank=8",
    ]


def assert_resumed_as_straight(job_dirs: Path) -> None:
    """The run resumed at epoch 1 read the reference from the checkpoint (its log says none was computed) and gave
    the straight run's epoch 1."""
    assert "DPO reference:" not in (job_dirs / "resumed" / "train.log").read_text()
    straight, resumed = (
        json.loads((job_dirs / name / "result.json").read_text())["history"] for name in ("straight", "resumed")
    )
    assert len(resumed) == 2
    for key in [f"{split}/{name}" for split in ("train", "val") for name in PAIR_KEYS]:
        assert resumed[1][key] == pytest.approx(straight[1][key], rel=1e-5, abs=1e-6), key


def straight_first_and_resumed(run: list[str], job_dirs: Path, home: Path) -> Path:
    """2 epochs straight; 1 epoch; epoch 1 resumed from that one's checkpoint: the last's path."""
    train([*run, f"hydra.run.dir={job_dirs / 'straight'}"], home)
    train([*run, "trainer.max_epochs=1", f"hydra.run.dir={job_dirs / 'first'}"], home)
    first = job_dirs / "first" / "checkpoints" / "last.ckpt"
    train([*run, f"hydra.run.dir={job_dirs / 'resumed'}", f"ckpt_path={first}"], home)
    return first


@pytest.mark.slow
def test_loras_reference_is_the_bases_and_a_resumed_run_goes_on_as_the_straight_one(preference_example, tmp_path, home):
    """With LoRA adapters on one device: the reference log-probabilities the run keeps in its checkpoint are,
    exactly, those the same run computes without adapters, and to float32 rounding those of transformers' own
    Qwen 3 loaded from the dir. Epoch 1 resumed from epoch 0's checkpoint (read before training starts) reads them
    back and gives the straight run's numbers; resumed with other pairs (a shorter data.seq_length cuts them
    differently), it is refused."""
    transformers = pytest.importorskip("transformers")
    model_dir, pairs = preference_example
    run = lora_dpo_run(preference_example)
    first = straight_first_and_resumed(run, tmp_path, home)
    full = [item for item in run if not item.startswith("model.lora")]
    train([*full, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'full'}"], home)
    other = train(
        [*run, f"hydra.run.dir={tmp_path / 'other'}", f"ckpt_path={first}", "data.seq_length=28"], home, False
    )
    assert other.returncode != 0 and "data.path: holds other pairs than the checkpoint's reference" in other.output

    def saved_reference(name: str) -> torch.Tensor:
        checkpoint = torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=False)
        return checkpoint[REFERENCE_KEY]

    assert torch.equal(saved_reference("first"), saved_reference("full"))
    assert torch.equal(saved_reference("resumed"), saved_reference("first"))
    data = PreferenceDataModule(str(pairs), str(model_dir), seq_length=32, val_fraction=0.1, batch_size=8, seed=0)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = base(input_ids=data.inputs.flatten(0, 1)).logits
    expected = per_token_log_probs(logits, data.targets.flatten(0, 1)).sum(-1).view(-1, 2)
    torch.testing.assert_close(saved_reference("first"), expected, rtol=1e-5, atol=1e-4)
    assert_resumed_as_straight(tmp_path)


@pytest.mark.slow
def test_a_sharded_run_resumed_reads_its_reference_back(preference_example, tmp_path, home):
    """Under fsdp over 2 processes, where Lightning reads the checkpoint only after on_fit_start: the resumed run
    computes no reference of its own and gives the straight run's epoch 1."""
    run = [*lora_dpo_run(preference_example), "strategy=fsdp", "trainer.devices=2", "data.batch_size=4"]
    straight_first_and_resumed(run, tmp_path, home)
    assert_resumed_as_straight(tmp_path)


def test_the_plan_holds_no_second_copy_of_the_model(preference_example):
    """DPO with LoRA plans the parameters, gradients and optimizer state of supervised LoRA fine-tuning, not a
    second model; its step runs two sequences a pair: twice the FLOPs of a step on as many conversations. The
    predicted step names the reference's one forward pass over all 128 pairs; supervised fine-tuning makes none."""
    from test_memory_plan import resolved

    from project.plan.memory_plan import plan_memory
    from project.plan.step_time import format_step, predict_step

    model_dir, pairs = preference_example
    chat = pairs.parent / "ahoy.jsonl"
    common = ["model=qwen3", f"model.init_from={model_dir}", "model.lora.rank=8", "data.seq_length=32"]
    common += ["cluster=h100_sxm_8x", "trainer.devices=2", "strategy=fsdp"]
    dpo_job = resolved(["experiment=dpo", *common, f"data.path={pairs}"])
    sft_job = resolved(["data=chat", *common, f"data.path={chat}"])
    dpo_plan, sft_plan = plan_memory(dpo_job, suggest=False), plan_memory(sft_job, suggest=False)
    dpo, sft = dpo_plan.devices[0], sft_plan.devices[0]
    assert (dpo.params, dpo.grads, dpo.optimizer) == (sft.params, sft.grads, sft.optimizer)
    assert dpo.params > 0 and dpo.optimizer > 0
    assert dpo.flops == pytest.approx(2 * sft.flops, rel=0.02)
    assert dpo_job.cluster is not None and sft_job.cluster is not None
    step = predict_step(dpo_plan, dpo_job, dpo_job.cluster)
    # 128 pairs over a global batch of 2 x 8 pairs: 8 steps' worth, a third of each
    assert (
        f"one forward pass over 128 samples (every pair, for DPO's reference): about {step.seconds * 8 / 3:.3g} s"
        in (format_step(step, dpo_job.cluster, dpo_job))
    )
    sft_step = predict_step(sft_plan, sft_job, sft_job.cluster)
    assert "Before the first step" not in format_step(sft_step, sft_job.cluster, sft_job)


@pytest.mark.slow
def test_mode_eval_of_a_checkpoint_gives_its_runs_last_validation(dpo_runs, preference_example, tmp_path, home):
    """mode=eval of the one-device run's last checkpoint reads the reference back from it (none computed) and gives
    the run's last epoch's validation loss, rewards, margins and accuracies."""
    model_dir, pairs = preference_example
    run = dpo_runs["auto"]
    checkpoint = run / "checkpoints" / "last.ckpt"
    data = [f"data.path={pairs}", f"data.tokenizer={model_dir}"]
    train([*DPO_OVERRIDES, *data, "mode=eval", f"ckpt_path={checkpoint}", f"hydra.run.dir={tmp_path}"], home)
    assert "DPO reference:" not in (tmp_path / "train.log").read_text()
    final = json.loads((tmp_path / "result.json").read_text())["final"]
    last = json.loads((run / "result.json").read_text())["history"][-1]
    for key in [f"val/{name}" for name in PAIR_KEYS]:
        assert final[key] == pytest.approx(last[key], rel=1e-6, abs=1e-7), key
