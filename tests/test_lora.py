"""LoRA (``model.lora``, project/models/lora.py) against Hugging Face ``peft`` on the same ``transformers`` model: the
same trainable parameters, loss and gradients; and a real run's checkpoint: the base untouched, only the adapters
trained and in the optimizer. (Every strategy's per-epoch numbers against peft's in the hand-written loop:
test_reference.py.)"""

import json
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import GPT_LORA, TINY_GPT, run_command, train
from hydra.utils import instantiate
from omegaconf import OmegaConf
from test_config import compose_train
from test_hf import LLAMA, LLAMA_EVAL, TOKENS, transformers_val_loss
from test_plan_search import SEARCH

from project.checkpointing.files import checkpoint_meta
from project.checkpointing.hf import HFWeights, hf_name, net_options, read_config
from project.cli.usage import merged_model_state, trained_lora
from project.model_options import LoRAFineTuning
from project.models import GPT, Llama
from project.models.init import initial_value
from project.models.lora import LoRA, apply_lora
from project.options.errors import ConfigError
from project.parallel.parallelize import materialize

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

SETTINGS = LoRA(rank=4, alpha=8.0, dropout=0.0, targets=("q", "v", "down"))
PEFT_TARGETS = ["q_proj", "v_proj", "down_proj"]  # the same layers, in transformers' names


def peft_name(name: str) -> str:
    """peft's name of this project's adapter parameter ``blocks.0.attn.q.lora_a.weight``."""
    layer, _, matrix = name.removesuffix(".weight").rpartition(".")
    hf_layer = hf_name("llama", f"{layer}.weight").removesuffix(".weight")
    return f"base_model.model.{hf_layer}.lora_{matrix[-1].upper()}.default.weight"


def test_lora_trains_what_peft_trains_with_its_loss_and_gradients(tmp_path):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    reference.save_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        net = Llama(**net_options(read_config(tmp_path / "hf")))
    apply_lora(net, SETTINGS)
    materialize(net, torch.device("cpu"), seed=0, weights=HFWeights(tmp_path / "hf"))
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=PEFT_TARGETS)
    theirs = peft.get_peft_model(reference, config)

    ours = {name: p for name, p in net.named_parameters() if p.requires_grad}
    trained = {name: p for name, p in theirs.named_parameters() if p.requires_grad}
    assert {peft_name(name) for name in ours} == set(trained)  # the same layers, nothing else trains
    assert sum(p.numel() for p in ours.values()) == sum(p.numel() for p in trained.values())
    assert sum(p.numel() for p in net.parameters()) == sum(p.numel() for p in theirs.parameters())
    with torch.no_grad():  # B is zero at the start (so the output is the model's); a random B tests the update
        for name, parameter in ours.items():
            if name.endswith("lora_b.weight"):
                parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
            trained[peft_name(name)].copy_(parameter)

    inputs, targets = TOKENS[:, :-1], TOKENS[:, 1:]
    loss = F.cross_entropy(net(inputs).flatten(0, 1), targets.flatten())
    expected = F.cross_entropy(theirs(inputs).logits.flatten(0, 1), targets.flatten())
    assert torch.allclose(loss, expected, rtol=0, atol=1e-5)
    loss.backward()
    expected.backward()
    for name, parameter in ours.items():
        assert torch.allclose(parameter.grad, trained[peft_name(name)].grad, rtol=0, atol=1e-5), name
    assert all(p.grad is None for p in net.parameters() if not p.requires_grad)


def test_lora_is_off_at_rank_0_and_on_with_a_rank_typed_as_a_key():
    """Every language model has model.lora's keys, off at rank 0 (every weight trains); model.lora.rank=8
    model.lora.alpha=16 puts adapters on the default targets, q and v, scaled by 16 / 8, the rest frozen."""
    with torch.device("meta"):
        plain = instantiate(compose_train(["model=llama", "data=tokens"]).model)
        adapted = instantiate(
            compose_train(["model=llama", "data=tokens", "model.lora.rank=8", "model.lora.alpha=16"]).model
        )
    assert all(parameter.requires_grad for parameter in plain.net.parameters())
    assert not any(isinstance(option, LoRAFineTuning) for option in plain.options)
    (lora,) = [option for option in adapted.options if isinstance(option, LoRAFineTuning)]
    assert lora.rank == 8 and lora.alpha == 16
    layers = {name: module for name, module in adapted.net.named_modules() if hasattr(module, "lora_a")}
    assert {name.rpartition(".")[2] for name in layers} == {"q", "v"} and len(layers) == 2 * plain.net.num_layers
    assert all(layer.lora_a.out_features == 8 and layer.scaling == 2.0 for layer in layers.values())
    trained = {name for name, parameter in adapted.net.named_parameters() if parameter.requires_grad}
    assert trained == {f"{name}.lora_{matrix}.weight" for name in layers for matrix in "ab"}


def test_a_job_saved_before_lora_was_a_typed_option_still_names_its_adapters():
    """export and generate read a job's saved config.yaml: one written when model.lora held the keys alone (or null)
    gives the same option as today's."""
    old = OmegaConf.create({"model": {"lora": {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q", "v"]}}})
    today = compose_train(["model=llama", "data=tokens", "model.lora.rank=4", "model.lora.alpha=8"])
    assert trained_lora(old) == trained_lora(today) == LoRAFineTuning(rank=4, alpha=8, targets=["q", "v"])
    assert trained_lora(OmegaConf.create({"model": {"lora": None}})) is None
    assert trained_lora(compose_train(["model=llama", "data=tokens"])) is None


def test_a_tied_model_with_lora_saves_its_adapters_alone():
    """A tied output layer is the frozen embedding under a second name: left out under both (Qwen3-0.6B, Llama 3.2
    1B and 3B tie theirs)."""
    cfg = compose_train(["model=llama", "data=tokens", "model.net.tie_weights=true", GPT_LORA.replace("up", "o")])
    module = instantiate(cfg.model)
    trained = {f"net.{name}" for name, parameter in module.net.named_parameters() if parameter.requires_grad}
    assert trained and set(module.state_dict()) == trained


def test_a_lora_checkpoint_goes_on_only_on_the_base_it_was_trained_on(gpt_lora_auto):
    """The seeded base of another seed is not the one the adapters were trained on: refused by its key."""
    checkpoint = gpt_lora_auto / "checkpoints" / "last.ckpt"
    assert checkpoint_meta(checkpoint)["lora_base"] == "seed 42"
    cfg = compose_train([*TINY_GPT, GPT_LORA, "seed=7"])
    with pytest.raises(ConfigError, match=r"seed: gives a base \(seed 7\) other than .* \(seed 42\)"):
        merged_model_state(checkpoint, cfg)
    assert set(merged_model_state(checkpoint, compose_train([*TINY_GPT, GPT_LORA]))) >= {"head.output.weight"}


def test_a_lora_run_trains_and_checkpoints_only_the_adapters(gpt_lora_auto):
    """The last checkpoint holds the adapters alone, moved from their seeded start, and their optimizer state alone;
    the share trained was printed."""
    checkpoint = torch.load(gpt_lora_auto / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = {
        key.removeprefix("net."): value for key, value in checkpoint["state_dict"].items() if key.startswith("net.")
    }
    cfg = compose_train([*TINY_GPT, GPT_LORA])
    with torch.device("meta"):
        net = GPT(**{key: value for key, value in cfg.model.net.items() if key != "_target_"})
    apply_lora(net, LoRA(4, 8.0, 0.0, ("q", "v", "up")))
    adapters = [name for name, parameter in net.named_parameters() if parameter.requires_grad]
    assert len(adapters) == 2 * 3 * cfg.model.net.num_layers  # A and B on 3 layers of each block
    assert sorted(state) == sorted(adapters)  # the frozen base is rebuilt from the config, not saved
    for name in adapters:
        assert not torch.equal(state[name], initial_value(net, name, cfg.seed)), name
    assert len(checkpoint["optimizer_states"][0]["state"]) == len(adapters)
    trained = sum(net.get_parameter(name).numel() for name in adapters)
    total = sum(parameter.numel() for parameter in net.parameters())
    log = (gpt_lora_auto / "train.log").read_text()
    assert f"training {trained:,} of {total:,} parameters ({trained / total:.2%}); the rest frozen." in log


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_a_lora_run_resumed_from_its_adapters_goes_on_as_the_uninterrupted_run(strategy, home, tmp_path):
    """Epoch 0, then epoch 1 resumed from its checkpoint (the adapters and their optimizer state, sharded; the base
    rebuilt from the seed): epoch 1's numbers are those of the run that trained both epochs (no LR schedule, whose
    length would differ)."""
    run = [*TINY_GPT, GPT_LORA, "logger=csv", f"strategy={strategy}", "trainer.devices=2", "model.scheduler=null"]
    train([*run, "trainer.max_epochs=2", f"hydra.run.dir={tmp_path / 'straight'}"], home)
    train([*run, "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'first'}"], home)
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert {path.suffix for path in last.iterdir()} >= {".distcp"}  # sharded: each rank its adapters' part
    train([*run, "trainer.max_epochs=2", f"hydra.run.dir={tmp_path / 'resumed'}", f"ckpt_path={last}"], home)
    expected, got = (
        json.loads((tmp_path / name / "result.json").read_text())["history"] for name in ("straight", "resumed")
    )
    assert len(got) == 2
    for key in ("train/loss", "val/loss"):
        assert [row[key] for row in got] == pytest.approx([row[key] for row in expected], rel=1e-5), key


@pytest.mark.slow
def test_a_llama_lora_run_exported_merged_and_as_a_peft_adapter_gives_its_val_loss(tmp_path, home):
    """A transformers Llama fine-tuned here with LoRA (model.init_from), then `python -m project.cli.export`: merged,
    transformers computes the run's last val/loss from the dir; with --adapter, peft loads the adapters onto the
    untouched base dir and computes it too."""
    torch.manual_seed(0)
    config = {key: value for key, value in LLAMA.items() if key not in ("rope_parameters", "rms_norm_eps")}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(tmp_path / "hf")
    job = tmp_path / "run"
    lora = "model.lora={rank:4,alpha:8,dropout:0.0,targets:[q,v,down]}"
    overrides = [*LLAMA_EVAL, f"model.init_from={tmp_path / 'hf'}", lora, "trainer.max_epochs=2"]
    train([*overrides, f"hydra.run.dir={job}"], home)
    run_loss = json.loads((job / "result.json").read_text())["final"]["val/loss"]
    checkpoint = str(job / "checkpoints" / "last.ckpt")
    for extra, out in (([], "merged"), (["--adapter"], "adapter")):
        result = run_command(
            [sys.executable, "-m", "project.cli.export", checkpoint, str(tmp_path / out), *extra], home
        )
        assert result.returncode == 0, result.output
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert transformers_val_loss(merged, overrides) == pytest.approx(run_loss, rel=1e-5)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert sorted(json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]) == [
        "down_proj",
        "q_proj",
        "v_proj",
    ]
    assert transformers_val_loss(adapted, overrides) == pytest.approx(run_loss, rel=1e-5)
    untouched = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()  # peft adapted `base`
    assert transformers_val_loss(untouched, overrides) != pytest.approx(run_loss, rel=1e-3)  # the adapters count
    # Nothing export did not write is replaced: not the run's own base (whose weights the adapters build on), not a
    # dir of another tool's files unless --replace says so; its own dir again needs no flag.
    export = [sys.executable, "-m", "project.cli.export", checkpoint]
    weights = (tmp_path / "hf" / "model.safetensors").read_bytes()
    result = run_command([*export, str(tmp_path / "hf")], home)
    assert (
        result.returncode == 1 and f"out: {tmp_path / 'hf'} is the run's base model (model.init_from)" in result.output
    )
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == weights
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "config.json").write_text("{}")
    result = run_command([*export, str(tmp_path / "notes")], home)
    assert result.returncode == 1 and "holds files an export did not write (config.json)" in result.output
    assert "add --replace" in result.output and (tmp_path / "notes" / "config.json").read_text() == "{}"
    assert run_command([*export, str(tmp_path / "notes"), "--replace"], home).returncode == 0
    assert run_command([*export, str(tmp_path / "merged")], home).returncode == 0
    # The checkpoint holds the adapters alone: a base dir rewritten with other weights is refused, not merged into.
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).save_pretrained(tmp_path / "hf")
    result = run_command([sys.executable, "-m", "project.cli.export", checkpoint, str(tmp_path / "again")], home)
    assert result.returncode == 1 and "model.init_from: gives a base (weights " in result.output, result.output
    assert "other than the one the checkpoint's adapters were trained on" in result.output
    shutil.rmtree(tmp_path / "hf")  # a base gone since training: named, not a traceback
    result = run_command([*export, str(tmp_path / "again")], home)
    assert result.returncode == 1 and "Traceback" not in result.output, result.output
    assert "model.init_from: is " in result.output and "which holds no model now" in result.output, result.output


def test_plan_search_with_lora_ranks_every_layout_tensor_parallel_ones_included(tmp_path, home):
    """LoRA trains under every layout of 2 GPUs: data parallel, FSDP, FSDP x tensor parallel (the adapters split with
    their layers) and pipeline, each ranked with the adapters' exact model state."""
    output = train(["plan=search", *SEARCH, GPT_LORA, f"paths.cache_dir={tmp_path}"], home).output
    assert "(12 layouts," in output
    ranked = [line for line in output.splitlines() if "strategy.tensor_parallel_size=2" in line]
    assert ranked and all(" yes " in line for line in ranked)  # simulated, fitting: ranked, not refused
    assert "Fastest that fits in 80.00 GiB: strategy=" in output
