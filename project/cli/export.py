"""python -m project.cli.export <checkpoint> <out dir>: a checkpoint as a Hugging Face model dir.

The checkpoint is a file (auto, ddp, model_parallel) or a sharded dir (fsdp, pipeline); its model is built from the
job's ``config.yaml`` (found beside ``checkpoints/``, or given with ``--config``). Only the model's tensors are
read, not the optimizer state. The dir holds ``config.json`` and ``model.safetensors``, for
``transformers.AutoModelForCausalLM.from_pretrained(<out dir>)``, and the run's tokenizer, for
``AutoTokenizer.from_pretrained(<out dir>)``: ``data=shards``' (the one its token ids are of), else the tokenizer
files of ``model.init_from``'s dir (its chat template included); byte-level and synthetic data have none.

A run with LoRA (``model.lora``) is exported merged: each adapted weight becomes ``W + B A alpha / rank``. With
``--adapter`` (Llama), the adapters alone are written as a ``peft`` adapter dir instead (``adapter_config.json`` and
``adapter_model.safetensors``), which ``peft.PeftModel.from_pretrained(<base model>, <out dir>)`` loads onto the
base model (``model.init_from``'s dir).

Nothing is overwritten that export did not write: the run's own base (``model.init_from``) is refused as the out dir
(the run's adapters, and its resumes, are of those weights), and so is a dir holding files another tool wrote,
unless ``--replace`` says to write over them. An export lists what it wrote, and of which run, in ``EXPORTED``
(``.exported.json``): exporting the same run into the same dir again needs no flag; another run's export there is
refused unless ``--replace``.
"""

import argparse
import json
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_file
from torch import nn

from project.checkpointing.files import job_config_file, model_state
from project.checkpointing.hf import EXPORT_AGAIN, NET_CLASSES, family_of, hf_name, read_config, write_hf_dir
from project.cli.usage import checkpoint_and_config, merged_model_state, run_cli, trained_lora
from project.data.prepared import prepared_meta
from project.data.shards import ShardsDataModule
from project.data.templated import TemplatedDataModule
from project.models import Llama
from project.models.lora import is_adapter
from project.options.errors import ConfigError, check_writable
from project.options.writes import written


@contextmanager
def step(what: str) -> Iterator[None]:
    """``what`` on stderr as it starts, and its seconds once done: a large model's export takes minutes."""
    print(f"{what}...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        print(file=sys.stderr)  # the error's own line follows
        raise
    print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


# What an export wrote in its dir, by name, and whose run it is: only an export of the same run may write over those
# files without --replace. Written before the export's files (``complete`` false) and again after them, so that an
# export interrupted between its files leaves a record of what they are.
EXPORTED = ".exported.json"


def exported_record(out: Path) -> dict[str, Any] | None:
    """The record of the export in ``out``, if any (one without a ``run`` is from a version that kept none)."""
    path = out / EXPORTED
    return json.loads(path.read_text()) if path.is_file() else None


def exporting_run(checkpoint: str | Path, config: str | Path | None) -> str:
    """The run an export is of: its job dir (the dir of its ``config.yaml``)."""
    return str(job_config_file(checkpoint, config).resolve().parent)


def check_destination(cfg: DictConfig, out: Path, replace: bool, run: str) -> None:
    """``ConfigError`` for an out dir whose files an export of ``run`` would replace but did not write: the run's
    base model (always), or (unless ``replace``) another run's export, or a dir holding other files; and for one
    that cannot be written."""
    check_writable("out", out, "give a dir you can write.")
    base = OmegaConf.select(cfg, "model.init_from")
    if base is not None and out.is_dir() and Path(base).is_dir() and out.samefile(base):
        raise ConfigError(
            "out",
            f"{out} is the run's base model (model.init_from): its weights would be replaced by the fine-tuned ones, "
            "and the run's checkpoints, which build on the base, could not be used again.",
            f"export to a dir of its own, e.g. {out.with_name(out.name + '-finetuned')}.",
        )
    if not out.is_dir() or replace:
        return
    record = exported_record(out)
    if record is not None and record.get("run") != run:
        what = "the export" if record.get("complete", True) else "an interrupted export"
        whose = f"of another run, {record['run']}" if record.get("run") else "whose run it did not record"
        raise ConfigError(
            "out",
            f"{out} holds {what} {whose}, which this export of {run} would replace.",
            "export to a dir of its own, or add --replace to write over it.",
        )
    if record is not None and not record.get("complete", True):
        return  # this run's export, interrupted: what it left is its own
    ours = set(record["files"]) if record is not None else set()
    others = sorted(path.name for path in out.iterdir() if path.name not in ours | {EXPORTED})
    if others:
        listed = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        raise ConfigError(
            "out",
            f"{out} holds files an export did not write ({listed}), which this one would replace or mix with.",
            "give a new or empty dir, or add --replace to write over them.",
        )


def record_exported(out: Path, run: str, files: list[str], complete: bool) -> None:
    with written(out / EXPORTED, "export record", EXPORT_AGAIN) as partial:
        record = {"run": run, "complete": complete, "files": sorted(files)}
        partial.write_text(json.dumps(record, indent=1) + "\n")


def export(
    checkpoint: str | Path,
    out: str | Path,
    config: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    replace: bool = False,
) -> tuple[Path, list[str]]:
    """The model of ``checkpoint`` as a Hugging Face dir ``out``, with the run's tokenizer (``export_tokenizer``:
    the dir and its tokenizer files' names); ``ConfigError`` naming the argument to fix (before anything is written)
    for a checkpoint, config, model or out dir it cannot export (``check_destination``)."""
    cfg = checkpoint_and_config(str(checkpoint), None if config is None else str(config))
    out = Path(out)
    run = exporting_run(checkpoint, config)
    check_destination(cfg, out, replace, run)
    net_cfg = cast(dict[str, Any], OmegaConf.to_container(cfg.model.net, resolve=True))
    with torch.device("meta"):
        net: nn.Module = instantiate(net_cfg)
    if not isinstance(net, NET_CLASSES):
        raise ConfigError(
            "checkpoint",
            f"holds a model of class {type(net).__name__}; Hugging Face model dirs hold GPT, Llama and "
            "mixture-of-experts models.",
            "export a checkpoint of model=gpt, model=llama or model=moe (or one of their presets or families).",
        )
    with step(f"Reading {checkpoint}"):
        state = merged_model_state(checkpoint, cfg)
    expected = {name for name, _ in net.named_parameters()}  # a tied weight once, under its first name
    state = {name: value for name, value in state.items() if name in expected}
    if set(state) != expected:
        raise ConfigError(
            "checkpoint",
            f"{checkpoint} lacks {sorted(expected - set(state))[:3]}: it is not a checkpoint of the job's model.",
            "pass the job's own config with --config <job dir>/config.yaml.",
        )
    size = sum(value.numel() for value in state.values()) * dtype.itemsize
    record_exported(out, run, ["config.json", "model.safetensors"], complete=False)
    with step(f"Writing {out / 'model.safetensors'} ({size / 2**30:.2f} GiB)"):
        write_hf_dir(state, net, net_cfg, out, dtype)
    tokenizer = export_tokenizer(cfg, out)
    record_exported(out, run, ["config.json", "model.safetensors", *tokenizer], complete=True)
    return out, tokenizer


def export_adapter(
    checkpoint: str | Path, out: str | Path, config: str | Path | None = None, replace: bool = False
) -> Path:
    """The LoRA adapters of ``checkpoint`` as a ``peft`` adapter dir ``out``, in transformers' names."""
    cfg = checkpoint_and_config(str(checkpoint), None if config is None else str(config))
    lora = trained_lora(cfg)
    if lora is None:
        raise ConfigError("--adapter", "the run trained no LoRA adapters (model.lora.rank is 0).", "export it whole.")
    net_class = get_class(cfg.model.net._target_)
    if net_class is not Llama:
        # GPT-2 keeps q, k and v as one fused layer, which one peft adapter of this rank cannot express; a
        # mixture's names are not Llama's.
        raise ConfigError(
            "--adapter", f"writes Llama adapters; this run's model is a {net_class.__name__}.", "export it merged."
        )
    base = OmegaConf.select(cfg, "model.init_from")
    if base is not None and (Path(base) / "config.json").is_file() and family_of(read_config(base)).fused:
        # Phi-3 fuses q, k and v (and gate and up) as GPT-2 does: peft adapts its fused layers, not their parts.
        raise ConfigError("--adapter", f"the run's base, {base}, fuses the layers adapted.", "export it merged.")
    out = Path(out)
    run = exporting_run(checkpoint, config)
    check_destination(cfg, out, replace, run)
    record_exported(out, run, ["adapter_model.safetensors", "adapter_config.json"], complete=False)
    adapters = {name: value for name, value in model_state(checkpoint).items() if is_adapter(name)}
    tensors, targets = {}, set()
    for name, value in adapters.items():
        layer, _, matrix = name.removesuffix(".weight").rpartition(".")
        hf_layer = hf_name("llama", f"{layer}.weight").removesuffix(".weight")
        targets.add(hf_layer.rpartition(".")[2])
        tensors[f"base_model.model.{hf_layer}.lora_{matrix[-1].upper()}.weight"] = value.float().contiguous()
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": OmegaConf.select(cfg, "model.init_from"),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    with written(out / "adapter_model.safetensors", "adapter weights", EXPORT_AGAIN) as partial:
        save_file(tensors, partial, metadata={"format": "pt"})
    with written(out / "adapter_config.json", "adapter config", EXPORT_AGAIN) as partial:
        partial.write_text(json.dumps(settings, indent=2) + "\n")
    record_exported(out, run, ["adapter_model.safetensors", "adapter_config.json"], complete=True)
    return out


# A Hugging Face model dir's tokenizer files (transformers' names), those of model.init_from's dir copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def export_tokenizer(cfg: DictConfig, out: Path) -> list[str]:
    """The run's tokenizer written into ``out`` (the files' names; none for data without one)."""
    data_class = get_class(cfg.data._target_)
    if issubclass(data_class, ShardsDataModule):
        meta = prepared_meta(cfg.data.path)
        with written(out / "tokenizer.json", "tokenizer", EXPORT_AGAIN) as partial:
            shutil.copyfile(Path(cfg.data.path) / meta["tokenizer_file"], partial)
        # transformers' fast tokenizer over that file, the corpus's document separator as its end of text
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": meta["separator"]["token"]}
        with written(out / "tokenizer_config.json", "tokenizer config", EXPORT_AGAIN) as partial:
            partial.write_text(json.dumps(settings, indent=2) + "\n")
        return ["tokenizer.json", "tokenizer_config.json"]
    # data=chat and data=preference: the dir whose tokenizer and chat template rendered the conversations (by default
    # init_from's)
    templated = issubclass(data_class, TemplatedDataModule)
    source = cfg.data.tokenizer if templated else OmegaConf.select(cfg, "model.init_from")
    if source is None:
        return []
    copied = [name for name in TOKENIZER_FILES if (Path(source) / name).is_file()]
    for name in copied:
        with written(out / name, "tokenizer file", EXPORT_AGAIN) as partial:
            shutil.copyfile(Path(source) / name, partial)
    return copied


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m project.cli.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint file or sharded checkpoint dir (checkpoints/last.ckpt)")
    parser.add_argument("out", help="the Hugging Face model dir to write")
    parser.add_argument("--config", help="the job's config.yaml (default: beside the checkpoints dir)")
    parser.add_argument(
        "--adapter", action="store_true", help="write a LoRA run's adapters alone, as a peft adapter dir (Llama)"
    )
    parser.add_argument(
        "--replace", action="store_true", help="write over files in the out dir that an export did not write"
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="the saved tensors' type (default float32)",
    )
    args = parser.parse_args(argv)
    if args.adapter:
        out = export_adapter(args.checkpoint, args.out, args.config, args.replace)
        print(f"Wrote {out}: adapter_config.json, adapter_model.safetensors (peft.PeftModel.from_pretrained)")
        return
    out, tokenizer = export(args.checkpoint, args.out, args.config, getattr(torch, args.dtype), args.replace)
    files = ", ".join(["config.json", "model.safetensors", *tokenizer])
    none = "" if tokenizer else " (no tokenizer: the run's data has none, its token ids are bytes or synthetic)"
    print(f"Wrote {out}: {files}{none}")


if __name__ == "__main__":
    run_cli("python -m project.cli.export", main)
