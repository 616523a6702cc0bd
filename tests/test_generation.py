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
from project.models.generation import generate, sample_group
from project.models.kv_cache import KeyValueCache
from project.parallel.parallelize import materialize

transformers = pytest.importorskip("transformers")


def random_hf_model_loaded(tmp_path, family: str, **shape) -> tuple:
    """A random transformers ``<family>ForCausalLM`` (seeded; no BOS or stop token), saved to ``tmp_path`` and loaded
    from there into this project's ``Llama``: the reference and ours."""
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=61,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        **shape,
    )
    reference = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    reference.save_pretrained(tmp_path)
    with torch.device("meta"):
        net = Llama(**net_options(read_config(tmp_path)))
    materialize(net, torch.device("cpu"), seed=0, weights=HFWeights(tmp_path))
    return reference, net


def test_greedy_generation_is_transformers_greedy_generation(tmp_path):
    """A random LlamaForCausalLM, loaded here: temperature 0 writes what transformers' generate(do_sample=False)
    writes, token for token."""
    reference, net = random_hf_model_loaded(tmp_path, "Llama")  # no stop token: 20 tokens
    prompt = [5, 17, 3, 42]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert generate(net.eval(), prompt, max_new_tokens=20, temperature=0) == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt"])
def test_passes_over_a_key_value_cache_give_the_whole_contexts_logits(family):
    """Rotary positions (grouped-query heads; Qwen 3's wider, normalised ones) and GPT's learned positions: the
    prompt's pass and each later one-token pass over the cache give the logits of the whole context run again."""
    torch.manual_seed(0)
    if family == "gpt":
        net = GPT(vocab_size=61, max_length=32, num_layers=2, dim=32, num_heads=4).eval()
    else:
        qwen3 = dict(head_dim=16, qk_norm=True) if family == "qwen3" else {}
        net = Llama(61, 32, 2, 32, 4, 2, 48, **qwen3).eval()
    context = torch.randint(0, 61, (3, 5))
    cache = KeyValueCache(len(net.blocks), 12)
    with torch.no_grad():
        torch.testing.assert_close(net(context, cache=cache), net(context), atol=1e-5, rtol=1e-5)
        for _ in range(6):
            token = torch.randint(0, 61, (3, 1))
            context = torch.cat([context, token], 1)
            torch.testing.assert_close(net(token, cache=cache)[:, -1], net(context)[:, -1], atol=1e-5, rtol=1e-5)
    assert cache.length == 11


def test_a_group_drawn_over_the_cache_at_top_k_1_is_transformers_greedy_generation(tmp_path):
    """A random Qwen3ForCausalLM, loaded here: each completion of a group drawn with only the most likely token
    allowed is what transformers' generate(do_sample=False), over its own cache, writes; the stop token ends it."""
    reference, net = random_hf_model_loaded(tmp_path, "Qwen3", head_dim=16)
    prompt = [5, 17, 3, 42]
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    expected = expected[0, len(prompt) :].tolist()
    drawn, lengths = sample_group(net.eval(), torch.tensor(prompt), 3, 16, torch.Generator(), {-1}, top_k=1)
    assert drawn.tolist() == [expected] * 3 and lengths.tolist() == [16] * 3
    stop = expected[6]  # its first appearance ends each completion there, kept
    end = expected.index(stop) + 1
    drawn, lengths = sample_group(net, torch.tensor(prompt), 2, 16, torch.Generator(), {stop}, top_k=1)
    assert lengths.tolist() == [end] * 2 and drawn[:, :end].tolist() == [expected[:end]] * 2
    assert not drawn[:, end:].any()


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
