"""python -m project.cli.chat_example OUT: a tiny chat model and conversations to fine-tune it on, offline.

Writes ``OUT/model``, a Hugging Face Qwen 3 dir of a tiny model (this project's ``model=qwen3`` preset, weights drawn
from ``--seed``) with a byte-level BPE ``tokenizer.json`` trained on the conversations, their ChatML chat template
(``chat_template.jinja``, Qwen's format) and a ``tokenizer_config.json`` transformers reads; and two sets of
conversations in which the assistant greets whoever the user names, some as ``messages`` (with a system message), some
as prompt/response pairs: ``OUT/hello.jsonl`` ("Hello, Ada! Nice to meet you.") and ``OUT/ahoy.jsonl`` ("Ahoy, Ada!
Welcome aboard."); and ``OUT/preference.jsonl``, pairs in TRL's preference format in which the "Ahoy" greeting is
chosen over the "Hello" one; for online RL, ``OUT/greetings.jsonl`` (the two sets' conversations taken in turn: a base
that greets both ways), ``OUT/prompts.jsonl`` (64 requests at most, in TRL's prompt-only format, each with the
``name`` to greet as a column) and ``OUT/rewards.py`` (reward functions for the "Hello" greeting and for naming the
person). docs/finetuning.md trains the model on the first set, then fine-tunes it with LoRA on the second, with DPO
on the pairs, or with GRPO on the prompts.
"""

import argparse
import json
import random
from pathlib import Path

import torch

from project.checkpointing.hf import write_hf_dir
from project.cli.prepare import train_bpe
from project.cli.usage import run_cli
from project.models import Llama, init_weights
from project.options.errors import ConfigError, check_writable
from project.options.writes import written

# Qwen's ChatML: each turn between <|im_start|>role and <|im_end|>; the generation prompt opens the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
NAMES = [
    "Ada", "Alan", "Barbara", "Claude", "Dennis", "Donald", "Edsger", "Frances", "Grace", "Guido", "John", "Ken",
    "Leslie", "Linus", "Margaret", "Niklaus", "Radia", "Richard", "Robin", "Shafi", "Sophie", "Tim", "Tony", "Yann",
]  # fmt: skip
ASKS = ["Please greet {}.", "Say hello to {}.", "Greet {}, please.", "Could you greet {}?"]
# The tiny model: a Qwen 3 of 2 blocks of width 128 (2 heads of 128, which 2 tensor-parallel ranks split), on this
# vocabulary and context. Its Linear weights are multiples of 16384 values, which NF4 can store (QLoRA).
NET = dict(
    max_length=64, num_layers=2, dim=128, num_heads=2, num_kv_heads=2, hidden_dim=128, rope_theta=1000000.0,
    norm_eps=1e-06, tie_weights=False, head_dim=128, qkv_bias=False, qk_norm=True, rope_scaling=None,
)  # fmt: skip


PROMPTS = 64  # at most: each is drawn a group of completions an epoch, token by token
GREETINGS = {"hello": "Hello, {}! Nice to meet you.", "ahoy": "Ahoy, {}! Welcome aboard."}


def conversations(count: int, seed: int, greeting: str) -> list[dict]:
    """``count`` records: a user names someone, the assistant greets them with ``greeting`` (a format with the
    name's place); every third as a prompt/response pair."""
    draw = random.Random(seed)
    records: list[dict] = []
    for index in range(count):
        name = draw.choice(NAMES)
        ask, answer = draw.choice(ASKS).format(name), greeting.format(name)
        if index % 3 == 2:
            records.append({"prompt": ask, "response": answer})
            continue
        messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
        if index % 3 == 1:
            messages.insert(0, {"role": "system", "content": "You are a polite assistant."})
        records.append({"messages": messages})
    return records


def preference_pairs(count: int, seed: int) -> list[dict]:
    """``count`` pairs: a user names someone; the "ahoy" greeting is chosen, the "hello" one rejected. Every other
    pair in TRL's conversational form (lists of messages), the rest as plain text."""
    draw = random.Random(seed)
    pairs: list[dict] = []
    for index in range(count):
        name = draw.choice(NAMES)
        ask = draw.choice(ASKS).format(name)
        chosen, rejected = GREETINGS["ahoy"].format(name), GREETINGS["hello"].format(name)
        if index % 2:
            pairs.append({"prompt": ask, "chosen": chosen, "rejected": rejected})
            continue
        pairs.append(
            {
                "prompt": [{"role": "user", "content": ask}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return pairs


# The reward functions of docs/finetuning.md's GRPO example: TRL's signature, the prompts' "name" column by name.
REWARDS = '''"""Rewards for GRPO (python -m project.cli.chat_example): model.grpo.reward_functions=[rewards.py:hello]"""


def hello(completions, **kwargs):
    """1 for a completion that greets with "Hello", else 0."""
    return [float(completion[0]["content"].startswith("Hello")) for completion in completions]


def names_the_person(completions, name, **kwargs):
    """1 for a completion that names the person the prompt's "name" column holds, else 0."""
    return [float(who in completion[0]["content"]) for completion, who in zip(completions, name)]
'''


def prompts(count: int, seed: int) -> list[dict]:
    """``count`` requests to greet someone, as messages, each with the ``name`` to greet as a column."""
    draw = random.Random(seed)
    names = [draw.choice(NAMES) for _ in range(count)]
    return [{"prompt": [{"role": "user", "content": draw.choice(ASKS).format(name)}], "name": name} for name in names]


def _texts(record: dict) -> list[str]:
    """What the tokenizer learns from: a record's roles and texts."""
    if "prompt" in record:
        return ["user", record["prompt"], "assistant", record["response"]]
    return [text for message in record["messages"] for text in (message["role"], message["content"])]


def write_example(out: Path, count: int = 512, seed: int = 0) -> Path:
    """Write the model dir and the conversations (``<greeting>.jsonl``) under ``out``; returns the model dir."""
    records = {
        name: conversations(count, seed + index, greeting) for index, (name, greeting) in enumerate(GREETINGS.items())
    }
    words = [text for chat in records.values() for record in chat for text in _texts(record)]
    tokenizer = train_bpe(iter(words), vocab_size=384)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    model_dir = out / "model"
    net_cfg = {**NET, "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}
    with torch.device("meta"):
        net = Llama(**net_cfg)  # type: ignore[arg-type]
    net.to_empty(device="cpu")
    with torch.no_grad():
        init_weights(net, seed)
    write_hf_dir(net.state_dict(), net, net_cfg, model_dir)
    again = "Write the example again."
    with written(model_dir / "tokenizer.json", "tokenizer", again) as partial:
        tokenizer.save(str(partial))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": NET["max_length"],
    }
    with written(model_dir / "tokenizer_config.json", "tokenizer config", again) as partial:
        partial.write_text(json.dumps(settings, indent=2) + "\n")
    with written(model_dir / "chat_template.jinja", "chat template", again) as partial:
        partial.write_text(CHAT_TEMPLATE)
    for name, chat in records.items():
        with written(out / f"{name}.jsonl", "conversations", again) as partial:
            partial.write_text("".join(json.dumps(record) + "\n" for record in chat))
    with written(out / "preference.jsonl", "preference pairs", again) as partial:
        pairs = preference_pairs(count, seed + len(records))
        partial.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    mixed = [records["hello" if index % 2 else "ahoy"][index] for index in range(count)]
    with written(out / "greetings.jsonl", "conversations", again) as partial:
        partial.write_text("".join(json.dumps(record) + "\n" for record in mixed))
    with written(out / "prompts.jsonl", "prompts", again) as partial:
        lines = prompts(min(count, PROMPTS), seed + len(records) + 1)
        partial.write_text("".join(json.dumps(record) + "\n" for record in lines))
    with written(out / "rewards.py", "reward functions", again) as partial:
        partial.write_text(REWARDS)
    return model_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m project.cli.chat_example", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the dir to write model/, the .jsonl files and rewards.py into")
    parser.add_argument("--conversations", type=int, default=512, help="how many in each file, pairs too (default 512)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' and conversations' seed (default 0)")
    args = parser.parse_args(argv)
    if args.conversations < 10:
        raise ConfigError("--conversations", f"is {args.conversations}.", "give 10 or more.")
    check_writable("out", args.out, "give a dir you can write.")
    model_dir = write_example(Path(args.out), args.conversations, args.seed)
    names = [f"{name}.jsonl" for name in [*GREETINGS, "preference", "greetings", "prompts"]] + ["rewards.py"]
    files = ", ".join(str(model_dir.parent / name) for name in names)
    print(f"Wrote {model_dir} (a tiny Qwen 3, its tokenizer and chat template), {files}.")


if __name__ == "__main__":
    run_cli("python -m project.cli.chat_example", main)
