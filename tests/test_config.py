"""The Hydra configs: every option composes, every field is documented, Hydra's CLI flags work."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_extra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from project.config.checks import check_config
from project.config.overrides import check_swept_keys, explained_unknown_keys, unknown_key_error
from project.config.resolvers import register_resolvers
from project.observability.console import program
from project.options.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
GROUPS = ["model", "data", "strategy", "trainer", "logger", "callbacks", "paths", "hydra", "experiment", "debug"]


def compose_train(overrides: list[str] = ()):
    """The config `python train.py <overrides>` gets, with Hydra's runtime set as in a real job."""
    register_resolvers()  # as train.py does
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
    cfg.hydra.runtime.output_dir = "/tmp/unused-job-dir"
    HydraConfig.instance().set_config(cfg)
    return cfg


def test_every_group_exists_with_options():
    for group in GROUPS:
        assert list((CONF / group).glob("*.yaml")), f"config group {group} has no options"
    assert {p.stem for p in (CONF / "strategy").glob("*.yaml")} >= {"auto", "ddp"}
    assert {p.stem for p in (CONF / "logger").glob("*.yaml")} >= {"wandb", "csv", "none"}
    assert {p.stem for p in (CONF / "debug").glob("*.yaml")} >= {"fast_dev_run", "overfit", "limit_batches"}


# Options that need a partner option: a language model needs token data and the other way round.
PARTNERS = {
    "model=gpt": ["data=tokens"],
    "model=llama": ["data=tokens"],
    "model=mistral": ["data=tokens"],
    "model=phi3": ["data=tokens"],
    "model=qwen": ["data=tokens"],
    "model=language_model": ["data=tokens"],
    "model=moe": ["data=tokens"],
    "model=mixtral": ["data=tokens"],
    "model=deepseek": ["data=tokens"],
    "data=tokens": ["model=gpt"],
    "data=text": ["model=gpt", "data.path=x.txt"],
}
OPTIONS = [
    f"{path.parent.name}={path.stem}"
    for path in sorted(CONF.glob("*/*.yaml"))
    if path.parent.name not in ("hydra", "paths", "trainer", "step_time")  # step_time: what every cluster takes
]


@pytest.fixture(scope="module")
def prepared_corpus(tmp_path_factory) -> Path:
    """A tiny corpus prepared for data=shards (its meta.json gives the model its vocabulary size)."""
    from project.cli.prepare import prepare

    root = tmp_path_factory.mktemp("prepared")
    (root / "corpus.txt").write_text("a small corpus of words, words and more words. " * 50)
    prepare([root / "corpus.txt"], root / "out", vocab_size=300, shard_tokens=1000, val_fraction=0.0)
    return root / "out"


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    """``python -m project.cli.chat_example``'s model dir, whose tokenizer gives data=chat its vocabulary."""
    from project.cli.chat_example import write_example

    return write_example(tmp_path_factory.mktemp("chat"), count=16)


@pytest.mark.parametrize("override", OPTIONS)
def test_every_option_composes_and_resolves(override, prepared_corpus, chat_model_dir):
    partners = next((extra for prefix, extra in PARTNERS.items() if override.startswith(prefix)), [])
    if override.startswith("hparams_search="):
        require_extra("optuna", "optuna")
    if override == "data=shards":
        partners = ["model=gpt", f"data.path={prepared_corpus}"]
    if override in ("data=chat", "experiment=lora", "experiment=qlora"):  # a chat model dir, its tokenizer and chats
        partners = ["model=qwen3", f"model.init_from={chat_model_dir}", f"data.path={chat_model_dir.parent}/ahoy.jsonl"]
    if override in ("data=preference", "experiment=dpo"):  # the chat model dir and its preference pairs
        pairs = f"data.path={chat_model_dir.parent}/preference.jsonl"
        partners = ["model=qwen3", f"model.init_from={chat_model_dir}", pairs]
    if override in ("data=prompts", "experiment=grpo"):  # the chat model dir, its prompts and reward functions
        prompts = f"data.path={chat_model_dir.parent}/prompts.jsonl"
        partners = ["model=qwen3", f"model.init_from={chat_model_dir}", prompts]
        partners += ["experiment=grpo", f"model.grpo.reward_functions=[{chat_model_dir.parent}/rewards.py:hello]"]
    cfg = compose_train([override, *partners])
    del cfg.hydra
    OmegaConf.resolve(cfg)  # every interpolation resolves
    assert cfg.seed is not None and "ckpt_path" in cfg and "tags" in cfg


KEY_LINE = re.compile(r"^\s*([\w/.@-]+):(\s|$)")
SELF_EXPLAINED = {"_target_", "_partial_", "defaults"}


def test_every_yaml_field_is_commented():
    """Each key line carries a comment on the line or the line above (``_target_`` and friends excepted).

    In ``@package _global_`` override files (experiment, debug) a bare ``section:`` line only leads to the
    fields it overrides, which are commented themselves.
    """
    missing = []
    for path in sorted(CONF.rglob("*.yaml")):
        lines = path.read_text().splitlines()
        global_override = "# @package _global_" in lines[0]
        assert lines and lines[0].startswith("#"), f"{path} lacks a header comment"
        block_scalar_indent = None
        for number, line in enumerate(lines):
            indent = len(line) - len(line.lstrip())
            if block_scalar_indent is not None:  # inside a `key: |` text block
                if line.strip() and indent <= block_scalar_indent:
                    block_scalar_indent = None
                else:
                    continue
            match = KEY_LINE.match(line)
            if not match:
                continue
            if line.rstrip().endswith("|"):
                block_scalar_indent = indent
            commented = "#" in line or lines[number - 1].lstrip().startswith("#")
            commented |= global_override and line.rstrip().endswith(":")
            if match.group(1) not in SELF_EXPLAINED and not commented:
                missing.append(f"{path.relative_to(REPO)}:{number + 1}: {line.strip()}")
    assert not missing, "fields without a comment:\n" + "\n".join(missing)


def test_defaults_train_the_seed_model_family():
    cfg = compose_train()
    assert cfg.hydra.runtime.choices.strategy == "auto"
    assert cfg.model.net._target_ == "project.models.MLP"
    assert cfg.data.batch_size > 0 and cfg.trainer.max_epochs == 5


def test_seed_large_model_experiment_is_seed_000():
    cfg = compose_train(["experiment=seed_large_model"])
    assert cfg.hydra.runtime.choices.strategy == "ddp"
    assert cfg.data.num_features == 10000 and list(cfg.model.net.hidden_dims) == [5000, 1000]
    assert cfg.data.num_classes == 10 and cfg.data.batch_size == 10
    assert cfg.model.optimizer._target_ == "torch.optim.SGD" and cfg.model.optimizer.lr == 0.01
    assert cfg.model.optimizer.momentum == 0.0 and cfg.trainer.max_epochs == 3


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_hydra_cli_flags():
    help_text = run_cli("--help")
    assert help_text.returncode == 0
    assert "strategy: auto, ddp, fsdp, model_parallel, pipeline" in help_text.stdout
    assert "logger: csv, none, wandb" in help_text.stdout
    assert "model: deepseek_v3_like, gpt, gpt_125m" in help_text.stdout
    job = run_cli("--cfg", "job", "strategy=ddp", "trainer.devices=2")
    assert job.returncode == 0
    printed = OmegaConf.create(job.stdout)
    assert printed.trainer.devices == 2 and printed.strategy._target_.endswith("DDPStrategy")
    info = run_cli("--info")
    assert info.returncode == 0 and "Config search path" in info.stdout


def test_unknown_group_option_lists_the_options():
    result = run_cli("strategy=ddpp")
    assert result.returncode != 0
    assert "Could not find 'strategy/ddpp'" in result.stderr and "ddp" in result.stderr and "auto" in result.stderr


def test_device_count_above_gpus_present(monkeypatch):
    """The GPU-count branch of the checks, on a machine pretending to have one GPU."""
    cfg = compose_train(["trainer.accelerator=gpu", "trainer.devices=2"])
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"trainer.devices: asks for 2 GPUs but this machine has 1"):
        check_config(cfg)


@pytest.mark.parametrize("capability,supported", [((9, 0), True), ((7, 5), False)])
def test_bf16_check_opens_no_cuda_context(monkeypatch, capability, supported):
    """The launcher (and every rank before choosing its GPU) checks bf16 from device properties only: anything
    that would open a CUDA context on GPU 0 raises here."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    monkeypatch.setattr("torch.cuda.get_device_capability", lambda index: capability)
    for opens_a_context in ["is_bf16_supported", "current_device", "set_device", "init", "synchronize"]:
        monkeypatch.setattr(f"torch.cuda.{opens_a_context}", lambda *args, **kwargs: pytest.fail("a CUDA context"))
    cfg = compose_train(["trainer.accelerator=gpu", "trainer.devices=2", "trainer.precision=bf16-mixed"])
    if supported:
        check_config(cfg)
    else:
        with pytest.raises(ConfigError, match="this GPU has no bfloat16 support"):
            check_config(cfg)


def test_closing_hints_name_the_environments_programs_as_the_shell_finds_them(monkeypatch):
    """With this environment's bin dir not on PATH (make made .venv, nobody activated it), a hint names its
    python by path (relative to the current dir, under it); activated, plain python."""
    monkeypatch.chdir("/")
    own = Path(sys.executable).parent / "python"
    monkeypatch.setenv("PATH", "/nonexistent")
    assert program("python") == str(own.absolute().relative_to("/"))
    monkeypatch.setenv("PATH", str(own.parent))
    assert program("python") == "python"
    assert program("no-such-program") == "no-such-program"


def test_a_key_the_config_has_or_can_take_is_not_refused_as_misspelt():
    """What the misspelt-key check (``unknown_key_error``, also run on a sweep's swept keys) lets through: a
    mandatory value not yet set (???), a list's index, any key of a node that takes new ones; and what it names:
    the nearest key, an index past a list's end."""
    cfg = OmegaConf.create({"data": {"path": "???"}, "model": {"net": {"dims": [64, 32]}}, "extra": {}})
    OmegaConf.set_struct(cfg, True)
    OmegaConf.set_struct(cfg.extra, False)
    for key in ("data.path", "model.net.dims.1", "extra.anything"):
        assert unknown_key_error(key, "1", cfg) is None, key
    misspelt = unknown_key_error("data.pth", "a.txt", cfg)
    assert misspelt is not None and misspelt.fix == "write data.path=a.txt."
    past = unknown_key_error("model.net.dims.2", "8", cfg)
    assert past is not None and past.problem == "is past the end of model.net.dims, a list of 2."


def test_an_optuna_search_space_is_checked_but_below_a_searched_group_or_added_with_plus():
    """A search space (``hydra.sweeper.params``) that searches a group (``model``) leaves that group's keys to each
    trial, and one that adds a key with + is not looked up; a misspelt key of a group it does not search is
    refused before the sweep dir is made."""
    cfg = compose_train(["hparams_search=optuna"])
    OmegaConf.set_readonly(cfg.hydra, False)  # Hydra's node, read-only once composed
    with open_dict(cfg):
        cfg.hydra.sweeper.params = {"model": "choice(mlp,gpt)", "model.net.dim": "choice(32,64)", "+x.y": "choice(1)"}
    check_swept_keys(cfg)  # returns: nothing refused
    with open_dict(cfg):
        cfg.hydra.sweeper.params = {"trainer.max_epoch": "choice(1,2)"}
    with pytest.raises(SystemExit, match="trainer.max_epoch: is not a key of trainer: did you mean trainer.max_epochs"):
        check_swept_keys(cfg)


def test_hydra_explains_unknown_keys_inside_the_context_alone(monkeypatch):
    """Hydra's private override step is wrapped only inside ``explained_unknown_keys`` (train.py's main), put back
    after, and left alone on a Hydra release it was not written against."""
    import hydra
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    hydras_own = ConfigLoaderImpl._apply_overrides_to_config
    with explained_unknown_keys():
        assert ConfigLoaderImpl._apply_overrides_to_config is not hydras_own
    assert ConfigLoaderImpl._apply_overrides_to_config is hydras_own
    monkeypatch.setattr(hydra, "__version__", "1.4.0")
    with explained_unknown_keys():
        assert ConfigLoaderImpl._apply_overrides_to_config is hydras_own
