"""Hugging Face interop, checked against ``transformers`` itself: its GPT2LMHeadModel and LlamaForCausalLM, random
weights saved locally, loaded here give the same logits; this project's models written as HF dirs and loaded by
transformers give them back. And the Llama presets against the published parameter counts."""

import csv
import json
import sys

import pytest
import torch
from conftest import TINY_GPT, run_command, train
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from test_config import compose_train

from project.checkpointing.hf import HFWeights, check_matches, net_options, read_config, write_hf_dir
from project.models import GPT, Llama, init_weights
from project.options.errors import ConfigError
from project.parallel.parallelize import materialize

transformers = pytest.importorskip("transformers")

# Small, but every feature of the families: GPT-2's tanh GELU and tied head; Llama's grouped-query attention, Llama
# 3's RoPE scaling (the sequence goes past its original context) and both head choices.
GPT2 = dict(vocab_size=61, n_positions=48, n_embd=32, n_layer=2, n_head=4, activation_function="gelu_new")
LLAMA = dict(
    vocab_size=61,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)
TOKENS = torch.randint(0, 61, (3, 40), generator=torch.Generator().manual_seed(0))


# The families on Llama's decoder, each with what sets it apart: Qwen 2's biases, Qwen 3's per-head norms on heads
# wider than hidden_size / heads, Mistral's window (longer than the tokens, so full attention computes the same).
QWEN_ROPE = {"rope_type": "default", "rope_theta": 1e6}
LLAMA_FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {"rope_parameters": QWEN_ROPE}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16, "rope_parameters": QWEN_ROPE}),
    "mistral": (transformers.MistralConfig, {"sliding_window": 64}),
    "phi3": (
        transformers.Phi3Config,
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "pad_token_id": None},
    ),
}


def hf_model(family: str, tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2, tie_word_embeddings=tied)).eval()
    config_class, options = LLAMA_FAMILIES[family]
    config = config_class(**{**LLAMA, **options}, tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # transformers starts biases and norms at 0 and 1: random, so a swap would show
        for name, parameter in model.named_parameters():
            if name.endswith(("bias", "norm.weight")):
                parameter.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model


def strip_gpt2_prefix(model_dir) -> None:
    """Rewrite a GPT-2 dir as GPT-2 was first published: names without ``transformer.``."""
    tensors = load_file(model_dir / "model.safetensors")
    save_file(
        {key.removeprefix("transformer."): value for key, value in tensors.items()},
        model_dir / "model.safetensors",
        metadata={"format": "pt"},
    )


@pytest.mark.parametrize(
    "family, tied",
    [
        ("gpt2", True),
        ("llama", False),
        ("llama", True),
        ("qwen2", True),
        ("qwen3", False),
        ("mistral", False),
        ("phi3", False),
    ],
)
def test_hugging_face_weights_in_and_out_give_transformers_logits(family, tied, tmp_path):
    """GPT-2 in its first-published names; the untied models in several safetensors files with their index. Each
    family is written back as itself, but Mistral and Phi-3, written as a Llama (the same computation without a
    window). Phi-3's fused projections have fewer key/value rows than query rows (grouped-query attention)."""
    reference = hf_model(family, tied)
    reference.save_pretrained(tmp_path / "hf", max_shard_size="40KB" if not tied else "5GB")
    if family == "gpt2":
        strip_gpt2_prefix(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file() == (not tied)
    options = net_options(read_config(tmp_path / "hf"))
    with torch.device("meta"):
        net = (GPT if family == "gpt2" else Llama)(**options)
    materialize(net, torch.device("cpu"), seed=0, weights=HFWeights(tmp_path / "hf"))
    assert (net.head.output.weight is net.stem.tokens.weight) == tied  # one tensor, trained once
    with torch.no_grad():
        expected = reference(TOKENS).logits
        assert torch.allclose(net(TOKENS), expected, rtol=0, atol=1e-5)

        # Out again, from this project's own (seeded) weights: transformers computes what this model does.
        init_weights(net, seed=1)
        write_hf_dir(net.state_dict(), net, options, tmp_path / "out")
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
        expected_class = type(reference).__name__.replace("Mistral", "Llama").replace("Phi3", "Llama")
        assert type(exported).__name__ == expected_class
        assert torch.allclose(exported(TOKENS).logits, net(TOKENS), rtol=0, atol=1e-5)
        assert not torch.allclose(exported(TOKENS).logits, expected, atol=1e-3)  # the new weights, not the old


def test_a_model_dir_of_another_shape_names_the_key_to_set(tmp_path):
    hf_model("llama", tied=False).save_pretrained(tmp_path / "hf")
    options = net_options(read_config(tmp_path / "hf"))
    with torch.device("meta"):
        net = Llama(**{**options, "num_kv_heads": 4})
    with pytest.raises(ConfigError, match=r"model.net.num_kv_heads: is 4, but .*config.json gives 2"):
        check_matches(tmp_path / "hf", net, {**options, "num_kv_heads": 4})
    with pytest.raises(ConfigError, match=r"Fix: set model.net.rope_scaling=\{factor:8.0,low_freq_factor:1.0,"):
        check_matches(tmp_path / "hf", net, {**options, "rope_scaling": None})  # as a command line writes it
    with pytest.raises(ConfigError, match=r"model.init_from: is a llama model, but model.net is a GPT"):
        check_matches(tmp_path / "hf", GPT(61, 16, 1, 32, 4), {})


def test_gpt2_loads_into_a_shorter_context_and_untied_for_split_strategies(tmp_path):
    """A 16-token GPT (data.seq_length=16) takes the first 16 rows of GPT-2's 48 positions, and an untied one (as
    model_parallel and pipeline need) starts its output layer as a copy of the embedding: transformers' logits."""
    reference = hf_model("gpt2", tied=True)
    reference.save_pretrained(tmp_path / "hf")
    options = {**net_options(read_config(tmp_path / "hf")), "max_length": 16, "tie_weights": False}
    with torch.device("meta"):
        net = GPT(**options)
    check_matches(tmp_path / "hf", net, options)
    materialize(net, torch.device("cpu"), seed=0, weights=HFWeights(tmp_path / "hf"))
    assert net.head.output.weight is not net.stem.tokens.weight
    with torch.no_grad():
        assert torch.allclose(net(TOKENS[:, :16]), reference(TOKENS[:, :16]).logits, rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match=r"data.seq_length: is 64, longer than the 48 positions"):
        check_matches(tmp_path / "hf", net, {**options, "max_length": 64})


@pytest.mark.parametrize(
    "preset, vocab_size, published",
    [
        ("llama_1b", 128256, 1_235_814_400),  # meta-llama/Llama-3.2-1B
        ("llama_3b", 128256, 3_212_749_824),  # meta-llama/Llama-3.2-3B
        ("llama_8b", 128256, 8_030_261_248),  # meta-llama/Llama-3.1-8B
        ("llama_70b", 128256, 70_553_706_496),  # meta-llama/Llama-3.1-70B
        ("llama_405b", 128256, 405_853_388_800),  # meta-llama/Llama-3.1-405B
        ("mistral_7b", 32768, 7_248_023_552),  # mistralai/Mistral-7B-v0.3
        ("phi3_mini", 32064, 3_821_079_552),  # microsoft/Phi-3-mini-4k-instruct
        ("qwen2_5_0_5b", 151936, 494_032_768),  # Qwen/Qwen2.5-0.5B
        ("qwen2_5_7b", 152064, 7_615_616_512),  # Qwen/Qwen2.5-7B
        ("qwen3_0_6b", 151936, 596_049_920),  # Qwen/Qwen3-0.6B
        ("qwen3_8b", 151936, 8_190_735_360),  # Qwen/Qwen3-8B
    ],
)
def test_llama_family_presets_have_the_published_parameter_counts(preset, vocab_size, published):
    """With each model's vocabulary, built on the meta device (nothing allocated); a tied weight counts once. (The
    counts are also what transformers' own classes give for these configs on the meta device.)"""
    cfg = compose_train([f"model={preset}", "data=tokens", f"data.vocab_size={vocab_size}", "data.seq_length=1024"])
    with torch.device("meta"):
        net = instantiate(cfg.model.net)
    assert sum(p.numel() for p in net.parameters()) == published


def transformers_val_loss(model: torch.nn.Module, overrides: list[str]) -> float:
    """Mean next-token cross-entropy of a transformers model over the validation set ``train.py <overrides>`` uses."""
    data = instantiate(compose_train(overrides).data)
    data.setup("fit")
    inputs, targets = data.val_set.tensors
    with torch.no_grad():
        logits = model(inputs).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


@pytest.mark.slow
def test_a_sharded_checkpoint_exported_gives_transformers_its_val_loss(gpt_ddp_fsdp_sweep, tmp_path, home):
    """The fsdp GPT's sharded last.ckpt through ``python -m project.cli.export``: transformers' GPT2LMHeadModel on the
    exported dir computes the run's own last val/loss."""
    job = gpt_ddp_fsdp_sweep[1]
    result = run_command(
        [sys.executable, "-m", "project.cli.export", str(job / "checkpoints" / "last.ckpt"), str(tmp_path / "hf")], home
    )
    assert result.returncode == 0, result.output
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    run_loss = json.loads((job / "result.json").read_text())["final"]["val/loss"]
    overrides = OmegaConf.load(job / ".hydra" / "overrides.yaml")
    assert transformers_val_loss(exported, list(overrides)) == pytest.approx(run_loss, rel=1e-5)


@pytest.mark.slow
def test_an_export_to_a_full_disk_ends_with_the_path_and_leaves_no_partial_file(gpt_ddp_fsdp_sweep, small_disk, home):
    """The weights do not fit the 16 KiB file system: the documented message naming the file, exit code 1, no
    traceback, and nothing half-written left: only the export's record, which says it did not complete (a re-run of
    the same run then writes over what it left without --replace)."""
    out = small_disk("16k") / "hf"
    checkpoint = gpt_ddp_fsdp_sweep[1] / "checkpoints" / "last.ckpt"
    result = run_command([sys.executable, "-m", "project.cli.export", str(checkpoint), str(out)], home)
    assert result.returncode == 1 and "Traceback" not in result.output, result.output[-3000:]
    assert f"Could not write weights {out / 'model.safetensors'}: No space left on device (ENOSPC)" in result.output
    assert "Free space on that disk, then export again." in result.output
    assert [path.name for path in out.iterdir()] == [".exported.json"]
    assert json.loads((out / ".exported.json").read_text())["complete"] is False


# model=llama on token data of LLAMA's vocabulary; its shape comes from the model dir (model.init_from).
LLAMA_EVAL = [
    *(item for item in TINY_GPT[1:] if not item.startswith("model.")),
    "model=llama",
    "data.vocab_size=61",
    "data.batch_size=8",
]


@pytest.mark.slow
def test_a_hugging_face_llama_evaluates_to_its_transformers_loss_under_each_strategy(runs_dir, home, tmp_path):
    """mode=eval model.init_from=<a LlamaForCausalLM dir> and no model.net option: the shape, RoPE theta and norm
    epsilon (transformers' defaults, 10000 and 1e-6, not model=llama's) come from its config.json. fsdp ranks read
    their shards' rows, pipeline stages their blocks' tensors, tensor-parallel ranks their heads' and units'
    slices; each job's val/loss is transformers' own on the same validation set."""
    torch.manual_seed(0)
    config = {key: value for key, value in LLAMA.items() if key not in ("rope_parameters", "rms_norm_eps")}
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    assert (reference.config.rope_parameters["rope_theta"], reference.config.rms_norm_eps) == (10000.0, 1e-6)
    reference.save_pretrained(tmp_path / "hf")
    sweep = runs_dir / "llama-eval"
    train(
        [
            "-m",
            *LLAMA_EVAL,
            "mode=eval",
            f"model.init_from={tmp_path / 'hf'}",
            "trainer.devices=2",
            "strategy=fsdp,pipeline,tensor_parallel",
            f"hydra.sweep.dir={sweep}",
        ],
        home,
    )
    expected = transformers_val_loss(reference, LLAMA_EVAL)
    for job in ("0", "1", "2"):
        result = json.loads((sweep / job / "result.json").read_text())
        assert result["status"] == "completed"
        assert result["final"]["val/loss"] == pytest.approx(expected, rel=1e-5), job


@pytest.mark.slow
def test_evaluating_a_sharded_checkpoint_logs_its_runs_last_val_loss(gpt_ddp_fsdp_sweep, tmp_path, home):
    """mode=eval on the fsdp GPT's sharded last.ckpt, under fsdp: the printed table, the CSV row and result.json
    hold the run's own last val/loss."""
    job = gpt_ddp_fsdp_sweep[1]
    overrides = list(OmegaConf.load(job / ".hydra" / "overrides.yaml"))  # strategy=fsdp, 2 devices, the tiny GPT
    out = tmp_path / "eval"
    output = train(
        [
            *overrides,
            "mode=eval",
            f"ckpt_path={job / 'checkpoints' / 'last.ckpt'}",
            "logger=csv",
            f"hydra.run.dir={out}",
        ],
        home,
    ).output
    run_loss = json.loads((job / "result.json").read_text())["final"]["val/loss"]
    assert "Validate metric" in output and "val/loss" in output
    with open(out / "csv" / "version_0" / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 1 and float(rows[0]["val/loss"]) == pytest.approx(run_loss, rel=1e-6)
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "completed" and result["final"]["val/loss"] == pytest.approx(run_loss, rel=1e-6)


def test_an_export_replaces_only_its_own_runs_export(gpt_ddp_fsdp_sweep, tmp_path, home, monkeypatch):
    """Another run's export in the out dir is refused, named, and left as it was unless --replace; the same run's
    is replaced without a flag, also after an export of it was interrupted between its files (whose leftovers are
    called that, not files another tool wrote)."""
    from project.cli import export as export_cli
    from project.options.errors import ConfigError

    ddp, fsdp = (job.resolve() for job in gpt_ddp_fsdp_sweep)
    checkpoint = {job: str(job / "checkpoints" / "last.ckpt") for job in (ddp, fsdp)}
    out = tmp_path / "hf"
    export_cli.export(checkpoint[fsdp], out)
    weights = (out / "model.safetensors").read_bytes()
    record = json.loads((out / ".exported.json").read_text())
    assert record == {"run": str(fsdp), "complete": True, "files": ["config.json", "model.safetensors"]}
    refused = run_command([sys.executable, "-m", "project.cli.export", checkpoint[ddp], str(out)], home)
    assert refused.returncode == 1 and "Traceback" not in refused.output, refused.output[-3000:]
    assert f"out: {out} holds the export of another run, {fsdp}, which this export of {ddp} would replace." in (
        refused.output
    )
    assert "Fix: export to a dir of its own, or add --replace to write over it." in refused.output
    assert (out / "model.safetensors").read_bytes() == weights
    export_cli.export(checkpoint[fsdp], out)  # the same run again: no flag needed

    def interrupted(state, net, net_cfg, out_dir, dtype) -> None:  # Ctrl-C after the first file
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(export_cli, "write_hf_dir", interrupted)
        with pytest.raises(KeyboardInterrupt):
            export_cli.export(checkpoint[ddp], out, replace=True)
    assert json.loads((out / ".exported.json").read_text())["complete"] is False
    with pytest.raises(ConfigError, match=f"holds an interrupted export of another run, {ddp}, which this export"):
        export_cli.export(checkpoint[fsdp], out)
    export_cli.export(checkpoint[ddp], out)  # the interrupted run's own re-run: its leftovers are its own
    assert json.loads((out / ".exported.json").read_text()) == {
        "run": str(ddp),
        "complete": True,
        "files": ["config.json", "model.safetensors"],
    }
