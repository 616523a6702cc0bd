"""A real text corpus that ships with every Python: prepare the sources of sixteen standard-library packages (6.5 MB
of Python) with a trained 1024-token BPE, then train the tiny GPT (model=gpt) on them for one epoch, on this
machine, nothing downloaded. Prints the commands and what they gave (tokens, validation loss, tokens/s, times),
the figures docs/data.md quotes (Preparing a corpus).

    python benchmarks/stdlib_corpus.py                  # in a temporary dir, removed afterwards
    python benchmarks/stdlib_corpus.py --dir data/stdlib --devices 2   # keep the corpus; ddp x 2

Not a test: it trains for a few minutes.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = [
    "asyncio",
    "concurrent",
    "ctypes",
    "distutils",
    "email",
    "http",
    "idlelib",
    "importlib",
    "json",
    "lib2to3",
    "logging",
    "multiprocessing",
    "tkinter",
    "unittest",
    "urllib",
    "xml",
]
MODEL = ["model=gpt", "data.seq_length=128", "data.batch_size=16", "trainer.max_epochs=1"]
VOCAB = 1024


def run(command: list[str], env: dict[str, str]) -> float:
    """Runs ``command`` in the repo; its wall time in seconds."""
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-4000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where to keep the prepared corpus and the job (default: temporary)")
    parser.add_argument("--devices", type=int, default=1, help="1: strategy=auto; more: ddp over that many processes")
    args = parser.parse_args()
    env = {**os.environ, "WANDB_MODE": "disabled"}
    with nullcontext(args.dir) if args.dir else tempfile.TemporaryDirectory(prefix="stdlib_corpus_") as root:
        root = Path(root)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        sources = [str(stdlib / name) for name in PACKAGES if (stdlib / name).is_dir()]
        prepared, job = root / "prepared", root / "job"
        shutil.rmtree(prepared, ignore_errors=True)
        shutil.rmtree(job, ignore_errors=True)
        prepare = [
            sys.executable,
            "-m",
            "project.cli.prepare",
            *sources,
            "--out",
            str(prepared),
            "--vocab-size",
            str(VOCAB),
        ]
        prepare_s = run(prepare, env)
        meta = json.loads((prepared / "meta.json").read_text())
        strategy = [] if args.devices == 1 else ["strategy=ddp", f"trainer.devices={args.devices}"]
        train = [
            sys.executable,
            "train.py",
            *MODEL,
            *strategy,
            "data=shards",
            f"data.path={prepared}",
            "logger=csv",
            "print_config=false",
            "~callbacks.progress_bar",
            f"hydra.run.dir={job}",
        ]
        train_s = run(train, env)
        final = json.loads((job / "result.json").read_text())["final"]
        splits = meta["splits"]
        print(
            f"python -m project.cli.prepare <the {len(sources)} package dirs under {stdlib}: {' '.join(PACKAGES)}> "
            f"--out {prepared.name} --vocab-size {VOCAB}   # {prepare_s:.0f} s"
        )
        print(
            f"python train.py {' '.join([*MODEL, *strategy])} data=shards data.path={prepared.name}"
            f"   # {train_s:.0f} s\n"
        )
        print(
            f"| tokens (train / val) | vocabulary | val loss after 1 epoch (uniform: ln {meta['vocab_size']} = "
            f"{math.log(meta['vocab_size']):.2f}) | val perplexity | training tokens/s | wall time of train.py |"
        )
        print("|---|---|---|---|---|---|")
        print(
            f"| {splits['train']['tokens']:,} / {splits['val']['tokens']:,} | {meta['vocab_size']} | "
            f"{final['val/loss']:.2f} | {final['val/perplexity']:.1f} | {final['perf/tokens_per_sec']:,.0f} | "
            f"{train_s / 60:.1f} min |"
        )


if __name__ == "__main__":
    main()
