"""data=chat (project/data/chat.py): conversations tokenized and masked as transformers' ``apply_chat_template`` with
its assistant mask does; bad records refused with their file and line; and training on the assistant's tokens only
gives, under fsdp and pipeline with gradient accumulation, the hand-written loop's per-epoch numbers."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, assert_matches_reference, isolated_env, only_run, two_job_sweep

from project.cli.chat_example import CHAT_TEMPLATE, write_example
from project.data.chat import ChatDataModule
from project.data.chat_template import ChatTemplate, trained_mask
from project.data.targets import IGNORE_INDEX
from project.data.templated import PAD_ID
from project.options.errors import ConfigError

transformers = pytest.importorskip("transformers")

# The example's template with its assistant turns in {% generation %} blocks, as transformers needs for its mask:
# each turn's text after its header, its end-of-turn token and newline included.
TAGGED_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Please greet Ada."}, {"role": "assistant", "content": "Hello, Ada!"}],
    [
        {"role": "system", "content": "You are a polite assistant."},
        {"role": "user", "content": "Say hello to Alan."},
        {"role": "assistant", "content": "Hello, Alan! Nice to meet you."},
        {"role": "user", "content": "And to Grace?"},
        {"role": "assistant", "content": "Hello, Grace!"},
    ],
]
CHAT_OVERRIDES = [
    "model=qwen3",
    "data=chat",
    "data.seq_length=32",
    "data.batch_size=16",
    "model.net.dim=32",
    "model.net.num_heads=2",
    "model.net.num_kv_heads=2",
    "model.net.hidden_dim=64",
    "trainer.max_epochs=3",
    "trainer.accumulate_grad_batches=2",
    "print_config=false",
    "~callbacks.progress_bar",
    "+trainer.enable_progress_bar=false",
]


@pytest.fixture(scope="session")
def chat_example(shared_tmp) -> tuple[Path, Path]:
    """``python -m project.cli.chat_example``'s tiny Qwen 3 dir (its tokenizer and template) and 256 conversations
    (the "Hello" ones)."""
    out = shared_tmp / "chat-example"
    if not (out / "hello.jsonl").is_file():
        write_example(out, count=256)
    return out / "model", out / "hello.jsonl"


def tagged_copy(model_dir: Path, tmp_path: Path) -> Path:
    """The model dir's tokenizer with the tagged template in place of its own."""
    tagged = tmp_path / "tagged"
    tagged.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tagged / name).write_bytes((model_dir / name).read_bytes())
    (tagged / "chat_template.jinja").write_text(TAGGED_TEMPLATE)
    return tagged


@pytest.mark.parametrize("tagged", [False, True], ids=["template-without-tags", "template-with-generation-tags"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one-turn", "system-and-two-turns"])
def test_a_conversation_tokenizes_and_masks_as_transformers_does(chat_example, tmp_path, messages, tagged):
    """Without tags, the turns found by rendering the conversation's beginnings; with them, the tags' own spans:
    both give transformers' ids and assistant mask from the tagged template, for the same tokenizer."""
    model_dir, _ = chat_example
    tagged_dir = tagged_copy(model_dir, tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(tagged_dir)
    expected = reference.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert sum(expected["assistant_masks"]) > 0
    template = ChatTemplate(tagged_dir if tagged else model_dir)
    assert template.has_generation_tags == tagged
    text, spans = template.assistant_spans(messages)
    assert text == reference.apply_chat_template(messages, tokenize=False)
    ids, mask = trained_mask(transformers_free_tokenizer(model_dir), text, spans)
    assert ids == expected["input_ids"]
    assert [int(m) for m in mask] == expected["assistant_masks"]
    trained_text = reference.decode([i for i, m in zip(ids, mask, strict=True) if m])
    turns = [m["content"] for m in messages if m["role"] == "assistant"]
    assert trained_text == "".join(f"{turn}<|im_end|>\n" for turn in turns)


def transformers_free_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_the_data_module_pads_each_conversation_and_targets_only_the_assistant(chat_example):
    model_dir, chat = chat_example
    data = ChatDataModule(str(chat), str(model_dir), seq_length=48, val_fraction=0.25, batch_size=4, seed=0)
    assert (data.num_train_samples, data.num_val_samples) == (192, 64)
    record = json.loads(chat.read_text().splitlines()[0])
    ids, mask = trained_mask(data.renderer.tokenizer, *ChatTemplate(model_dir).assistant_spans(record["messages"]))
    length = len(ids) - 1
    assert data.inputs[0, :length].tolist() == ids[:-1]
    assert (data.inputs[0, length:] == PAD_ID).all() and (data.targets[0, length:] == IGNORE_INDEX).all()
    expected = [token if trained else IGNORE_INDEX for token, trained in zip(ids[1:], mask[1:], strict=True)]
    assert data.targets[0, :length].tolist() == expected
    assert data.renderer.tokenizer.decode([t for t in expected if t != IGNORE_INDEX]) == (
        record["messages"][-1]["content"] + "<|im_end|>\n"
    ).replace("<|im_end|>", "")  # decode drops special tokens


@pytest.mark.parametrize(
    "line, problem",
    [
        ("not json", "is not JSON"),
        ('{"messages": []}', "has an empty conversation"),
        ('{"messages": [{"content": "hi"}]}', "message 0 has no role"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "has no assistant message"),
        ('{"text": "hi"}', "neither messages nor prompt and response"),
        ('{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}', "fails on it"),
    ],
)
def test_a_bad_record_is_refused_with_its_file_and_line(chat_example, tmp_path, line, problem):
    model_dir, chat = chat_example
    strict = tmp_path / "strict"  # a template that refuses roles it does not know, as many do
    strict.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (strict / name).write_bytes((model_dir / name).read_bytes())
    refusing = "{% for m in messages %}{% if m['role'] == 'robot' %}{{ raise_exception('no robots') }}{% endif %}"
    (strict / "chat_template.jinja").write_text(refusing + "{% endfor %}" + CHAT_TEMPLATE)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(chat.read_text().splitlines()[:3] + [line]) + "\n")
    with pytest.raises(ConfigError, match=rf"data.path: {bad}:4: .*{problem}"):
        ChatDataModule(str(bad), str(strict), seq_length=48, val_fraction=0.25, batch_size=4, seed=0)


@pytest.fixture(scope="session")
def chat_sweep(chat_example, runs_dir, home):
    """The tiny Qwen 3 on the example's conversations, from seeded weights (data.tokenizer: the example's dir), under
    fsdp, pipeline and tensor_parallel over 2 devices, 2 batches accumulated per step: the sweep dir."""
    model_dir, chat = chat_example
    args = [*CHAT_OVERRIDES, f"data.path={chat}", f"data.tokenizer={model_dir}", "trainer.devices=2"]
    return two_job_sweep("chat", [*args, "strategy=fsdp,pipeline,tensor_parallel"], runs_dir, home)[1][0].parent


@pytest.mark.slow
@pytest.mark.parametrize("job", [0, 1, 2], ids=["fsdp", "pipeline", "tensor_parallel"])
def test_training_on_the_assistant_tokens_matches_the_hand_written_loop(chat_sweep, chat_example, reference, job):
    """Each replica's batches and each micro-batch leave out different numbers of targets; the loss, summed over
    the trained ones and divided by the positions, is the global batch's as the loop computes it, and the epoch
    metrics are means over the trained tokens. Under tensor parallelism, torch's loss_parallel leaves them out of
    the vocabulary-split logits' loss."""
    model_dir, chat = chat_example
    overrides = [*CHAT_OVERRIDES, f"data.path={chat}", f"data.tokenizer={model_dir}"]
    history = reference(overrides, 32 if job == 0 else 16).history  # fsdp: 2 replicas of 16; the others: 1
    assert_matches_reference(only_run(chat_sweep / str(job)), history)
    assert history[-1]["val/loss"] < history[0]["val/loss"]


def fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.S | re.M)


def val_loss(model: torch.nn.Module, data: ChatDataModule) -> float:
    """The mean cross-entropy of a transformers (or peft) model over the assistant tokens of the validation set."""
    data.setup("fit")
    inputs, targets = data.val_set.tensors
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)
    return (losses / (targets != IGNORE_INDEX).sum()).item()


def greeting(model: torch.nn.Module, tokenizer_dir: Path) -> str:
    """A transformers model's greedy answer to "Please greet Ada." in the dir's chat template."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    chat = [{"role": "user", "content": "Please greet Ada."}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True, return_tensors="pt")
    output = model.generate(**prompt, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_the_finetuning_page_runs_word_for_word(tmp_path, home):
    """docs/finetuning.md's commands, as a user runs them from a clone (train.py and conf/ here, the rest installed):
    the base says hello, the LoRA fine-tune ahoy, merged and as a peft adapter on the base, and so does the QLoRA
    fine-tune; both LoRA exports give transformers and peft the run's last val/loss on its validation
    conversations; DPO on the pairs that prefer "Ahoy" makes the base say it, in generate and, exported, in
    transformers, with the margins and log-probabilities the page states, and without RPO's term says neither; and
    GRPO rewarding "Hello" raises the reward each epoch, by the page's figures, and makes greedy decoding say it."""
    peft = pytest.importorskip("peft")
    for name in ("train.py", "conf"):
        (tmp_path / name).symlink_to(REPO / name)
    page = (REPO / "docs" / "finetuning.md").read_text()
    env = {**isolated_env(home), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    outputs = []
    for block in fenced_blocks(page, "bash"):
        result = subprocess.run(
            ["bash", "-e", "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, (block, (result.stdout + result.stderr)[-4000:])
        outputs.append(result.stdout)
    out = tmp_path / "logs" / "finetune"
    assert "training 73,728 of 534,144 parameters (13.80%)" in (out / "lora-run" / "train.log").read_text()
    assert outputs[2].rstrip().endswith("Ahoy, Grace! Welcome aboard.<|im_end|>")  # generate --chat
    assert "the rest frozen, the blocks' Linear weights in 4-bit NF4." in (out / "qlora-run" / "train.log").read_text()
    assert outputs[4].rstrip().endswith("Ahoy, Grace! Welcome aboard.<|im_end|>")  # QLoRA's generate --chat
    log = (out / "dpo-run" / "train.log").read_text()
    assert "DPO reference: the log-probabilities of all 512 pairs under the model before its first step" in log
    dpo = json.loads((out / "dpo-run" / "result.json").read_text())["final"]
    assert dpo["val/rewards/accuracies"] == 1.0
    alone, greedy = dpo_without_its_sft_term(page, tmp_path, env)
    assert "Ahoy" not in greedy and "Hello" not in greedy
    assert_figures_stated(page, dpo, alone)
    assert "Say hello to Grace.<|im_end|>\n<|im_start|>assistant\nAhoy, Grace! Welcome aboard.<|im_end|>" in outputs[5]
    assert greeting(transformers.AutoModelForCausalLM.from_pretrained(out / "dpo-merged"), out / "dpo-merged") == (
        "Ahoy, Ada! Welcome aboard."
    )
    history = json.loads((out / "grpo-run" / "result.json").read_text())["history"]
    rewards = [row["train/reward"] for row in history]
    assert rewards == sorted(rewards) and rewards[0] < rewards[-1]  # GRPO: the reward rises each epoch
    stated = re.search(r"rises from (\d\.\d+) to (\d\.\d+) and (\d\.\d+)", " ".join(page.split()))
    assert stated is not None and rewards == pytest.approx([float(value) for value in stated.groups()], rel=0.1)
    assert outputs[6].rstrip().endswith("Hello, Grace! Nice to meet you.<|im_end|>")  # the rewarded greeting
    expected_lines = fenced_blocks(page, "text")[0].splitlines()
    assert outputs[3].splitlines()[-len(expected_lines) :] == expected_lines  # after the exports' own lines
    expected = json.loads((out / "lora-run" / "result.json").read_text())["final"]["val/loss"]
    data = ChatDataModule(
        str(out / "ahoy.jsonl"), str(out / "base"), seq_length=48, val_fraction=0.1, batch_size=8, seed=0
    )
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    assert val_loss(merged, data) == pytest.approx(expected, rel=1e-5)
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base")
    adapted = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    assert val_loss(adapted, data) == pytest.approx(expected, rel=1e-5)


def dpo_without_its_sft_term(page: str, cwd: Path, env: dict[str, str]) -> tuple[dict, str]:
    """The page's DPO run as its figures without RPO's term were measured: ``model.dpo.sft_weight=0`` for 2 epochs,
    into its own dir; its final metrics, and what ``generate --chat`` answers after it."""
    block = next(block for block in fenced_blocks(page, "bash") if "experiment=dpo" in block)
    train, generate, _export = re.split(r"\n(?=python )", block.strip())
    changed = "model.dpo.sft_weight=0 trainer.max_epochs=2"
    train = train.replace("model.dpo.sft_weight=1.0 trainer.max_epochs=3", changed).replace("dpo-run", "dpo-alone")
    generate = generate.replace("dpo-run", "dpo-alone")
    assert changed in train and "dpo-alone" in generate
    result = subprocess.run(
        ["bash", "-e", "-c", f"{train}\n{generate}"], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    final = json.loads((cwd / "logs" / "finetune" / "dpo-alone" / "result.json").read_text())["final"]
    return final, result.stdout.rstrip().rpartition("<|im_start|>assistant")[2]


def assert_figures_stated(page: str, dpo: dict, alone: dict) -> None:
    """Each figure docs/finetuning.md states of its DPO runs, the last number of a phrase of the page, is the runs' to
    10% (the page's tolerance). The base's log-probabilities are the reference's: the policy's less its reward over
    beta (experiment=dpo's 0.1)."""

    def base(name: str) -> float:
        return dpo[f"val/logps/{name}"] - dpo[f"val/rewards/{name}"] / 0.1

    figures = {
        "`val/rewards/margins` 9.1": dpo["val/rewards/margins"],
        "log-probability of the chosen answer is -89": base("chosen"),
        "of the rejected hello, -18": base("rejected"),
        "the chosen one is at -12.6": dpo["val/logps/chosen"],
        "the rejected one at -32": dpo["val/logps/rejected"],
        "a margin of 12.2": alone["val/rewards/margins"],
        "pushed down to -112": alone["val/logps/rejected"],
        "rises only to -61": alone["val/logps/chosen"],
    }
    prose = " ".join(page.split())
    for phrase, measured in figures.items():
        assert phrase in prose, phrase
        stated = float(re.findall(r"-?\d+(?:\.\d+)?", phrase)[-1])
        assert measured == pytest.approx(stated, rel=0.1), (phrase, measured)


def test_the_end_of_an_assistant_turn_is_the_templates_own_token(chat_example):
    """What generate --chat stops at: the first token after a turn's text (ChatML's <|im_end|>)."""
    model_dir, _ = chat_example
    tokenizer = transformers_free_tokenizer(model_dir)
    assert ChatTemplate(model_dir).end_of_turn(tokenizer) == tokenizer.token_to_id("<|im_end|>")
