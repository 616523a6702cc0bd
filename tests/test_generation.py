"""Generation: greedy decoding against transformers' own ``generate``; temperature and top-k from their definitions;
the text_sample callback in a real run, and ``python -m project.cli.generate`` writing the same text from its
checkpoint."""

import json
import sys

import pytest
import torch
from conftest import TINY_GPT, only_run, run_command, train

from project.checkpointing.hf import HFWeights, net_options, read_config
from project.data.codecs import BytesCodec
from project.models import GPT, Llama
from project.models.generation import generate
from project.parallel.parallelize import materialize

transformers = pytest.importorskip("transformers")


def test_greedy_generation_is_transformers_greedy_generation(tmp_path):
    """A random LlamaForCausalLM, loaded here: temperature 0 writes what transformers' generate(do_sample=False)
    writes, token for token."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
    )  # no stop token: 20 tokens
    reference = transformers.LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    with torch.device("meta"):
        net = Llama(**net_options(read_config(tmp_path)))
    materialize(net, torch.device("cpu"), seed=0, weights=HFWeights(tmp_path))
    prompt = [5, 17, 3, 42]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert generate(net.eval(), prompt, max_new_tokens=20, temperature=0) == expected[0, len(prompt) :].tolist()


def test_sampling_follows_temperature_and_top_k():
    torch.manual_seed(0)
    net = GPT(vocab_size=40, max_length=16, num_layers=1, dim=32, num_heads=2).eval()
    prompt = [1, 2, 3]
    with torch.no_grad():
        logits = net(torch.tensor([prompt]))[0, -1]
    top3 = set(torch.topk(logits, 3).indices.tolist())
    firsts = [generate(net, prompt, 1, temperature=1.5, top_k=3, seed=seed)[0] for seed in range(200)]
    assert set(firsts) == top3  # each of the three most likely tokens drawn, and nothing else
    greedy = generate(net, prompt, 12, temperature=0)
    assert generate(net, prompt, 12, temperature=2.0, top_k=1, seed=7) == greedy  # k=1 leaves only the argmax
    assert generate(net, prompt, 12, temperature=1.0, seed=3) == generate(net, prompt, 12, temperature=1.0, seed=3)
    # The context is cut to the position table's 16 tokens: 30 tokens from a 3-token prompt still run.
    assert len(generate(net, prompt, 30, temperature=0, max_length=16)) == 30


@pytest.mark.slow
def test_a_run_writes_text_samples_and_its_checkpoint_writes_the_last_one_again(home, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. the dog sat on the log. " * 400)
    prompt = "the cat"
    job = tmp_path / "job"
    args = [
        *TINY_GPT[:1],
        "data=text",
        f"data.path={corpus}",
        "data.seq_length=32",
        "model.net.dim=32",
        "model.net.num_heads=2",
        "trainer.max_epochs=2",
        "data.batch_size=16",
        *TINY_GPT[-3:],
        f"callbacks.text_sample.prompt='{prompt}'",
        "callbacks.text_sample.max_new_tokens=24",
    ]
    output = train([*args, f"hydra.run.dir={job}"], home).output
    samples = [line.split(": ", 1)[1] for line in output.splitlines() if line.startswith("Sample (epoch")]
    assert len(samples) == 2 and all(sample.startswith(prompt) for sample in samples)
    assert len(BytesCodec().encode(samples[-1])) == len(prompt) + 24  # bytes: one token each
    table = only_run(job).summary["samples"]
    assert table["_type"] == "table-file" and table["nrows"] == 2
    again = run_command(
        [
            sys.executable,
            "-m",
            "project.cli.generate",
            str(job / "checkpoints" / "last.ckpt"),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "24",
        ],
        home,
    )
    assert again.returncode == 0, again.output
    assert again.stdout.rstrip("\n") == samples[-1]
    assert json.loads((job / "result.json").read_text())["status"] == "completed"
