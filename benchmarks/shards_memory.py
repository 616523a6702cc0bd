"""Does host memory stay flat as the corpus grows, and does the shard loader keep up with training?

Writes two token sets of random tokens in the format ``python -m project.cli.prepare`` writes (shards of 1e8
uint16 tokens, a header each, ``meta.json``): a small one (50 MB) and a large one (5 GB by default). Then:

1. **Memory.** Trains the tiny GPT (``model=gpt data=shards``, ``strategy=ddp trainer.devices=2``, two DataLoader
   workers per rank) for the same number of steps on each set, and samples every process of the run from
   ``/proc`` (every 0.1 s): the peak resident memory (``VmHWM``) of each rank and of each DataLoader worker, and
   how much of it is anonymous (the process's own) rather than the shards' mapped file pages (page cache, shared
   and reclaimable).
2. **Speed.** Reads training batches (16 sequences of 256 tokens, two workers) from the large set's loader alone,
   and compares its tokens/s with the tokens/s the training run consumed (``perf/tokens_per_sec``).

    python benchmarks/shards_memory.py                       # 5 GB set in a temporary dir, removed afterwards
    python benchmarks/shards_memory.py --dir /data/bench     # keep the sets there (reused if present)
    python benchmarks/shards_memory.py --large-gb 50

Not a test: it writes the sets (5 GB of disk) and takes a few minutes.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from project.data.shards import (  # noqa: E402
    ShardsDataModule,  # noqa: E402
    token_dtype,
    write_shard,
)

VOCAB = 8192
SHARD_TOKENS = 10**8
SEQ, BATCH, WORKERS, STEPS = 256, 16, 2, 100
MB = 2**20


def make_token_set(out: Path, train_tokens: int, seed: int) -> Path:
    """Random tokens as a prepared corpus: train shards of ``SHARD_TOKENS`` and a small validation shard."""
    if (out / "meta.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype = token_dtype(VOCAB)
    splits = {}
    for split, total in (("train", train_tokens), ("val", 200_000)):
        shards = []
        for index, start in enumerate(range(0, total, SHARD_TOKENS)):
            count = min(SHARD_TOKENS, total - start)
            name = f"{split}_{index:06d}.bin"
            write_shard(out / name, rng.integers(0, VOCAB, count, dtype=dtype))
            shards.append({"file": name, "tokens": count})
        splits[split] = {"tokens": total, "shards": shards}
    meta = {
        "format": "project token shards v1",
        "tokenizer": "random tokens (benchmark)",
        "vocab_size": VOCAB,
        "dtype": dtype.name,
        "shard_tokens": SHARD_TOKENS,
        "splits": splits,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return out


def status(pid: int) -> dict[str, int]:
    """The ``kB`` lines of /proc/<pid>/status that matter here, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status") as file:
        for line in file:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


def children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(parent, []).append(int(stat.parent.name))
    return tree


def sample_tree(root: int, peaks: dict[str, dict[int, dict[str, int]]], stop: threading.Event) -> None:
    """Every 0.1 s, the peak of each field for each rank (child of the launcher) and worker (child of a rank)."""
    while not stop.is_set():
        tree = children()
        for kind, pids in (
            ("rank", tree.get(root, [])),
            ("worker", [w for rank in tree.get(root, []) for w in tree.get(rank, [])]),
        ):
            for pid in pids:
                try:
                    fields = status(pid)
                except OSError:
                    continue
                peak = peaks[kind].setdefault(pid, {})
                for key, value in fields.items():
                    peak[key] = max(peak.get(key, 0), value)
        stop.wait(0.1)


def train(data: Path, job: Path) -> dict:
    """The tiny GPT for STEPS steps under ddp x 2, sampled; the peaks and the run's tokens/s."""
    command = [
        sys.executable,
        "train.py",
        "model=gpt",
        "data=shards",
        f"data.path={data}",
        f"data.seq_length={SEQ}",
        f"data.batch_size={BATCH}",
        f"data.num_workers={WORKERS}",
        "strategy=ddp",
        "trainer.devices=2",
        f"trainer.max_steps={STEPS}",
        "trainer.max_epochs=-1",
        "+trainer.limit_val_batches=4",
        "trainer.num_sanity_val_steps=0",
        "logger=none",
        "print_config=false",
        "~callbacks.progress_bar",
        "~callbacks.model_checkpoint",
        f"hydra.run.dir={job}",
    ]
    peaks: dict[str, dict[int, dict[str, int]]] = {"rank": {}, "worker": {}}
    stop = threading.Event()
    run = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    sampler = threading.Thread(target=sample_tree, args=(run.pid, peaks, stop))
    sampler.start()
    _, errors = run.communicate()
    stop.set()
    sampler.join()
    if run.returncode:
        raise SystemExit(f"training failed:\n{errors[-4000:]}")
    history = json.loads((job / "result.json").read_text())["history"]
    return {"peaks": peaks, "tokens_per_sec": history[-1]["perf/tokens_per_sec"]}


def loader_tokens_per_sec(data: Path, batches: int = 2000) -> float:
    """The training loader of one rank (of two), read alone: tokens per second over ``batches`` after warm-up."""
    module = ShardsDataModule(str(data), seq_length=SEQ, batch_size=BATCH, seed=0, num_workers=WORKERS)
    module.trainer = SimpleNamespace(distributed_sampler_kwargs={"rank": 0, "num_replicas": 2})
    module.setup("fit")
    iterator = iter(module.train_dataloader())
    for _ in range(50):  # workers started, first pages read
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        inputs, _ = next(iterator)
    return batches * inputs.numel() / (time.perf_counter() - start)


def row(name: str, size_bytes: int, result: dict) -> str:
    ranks, workers = result["peaks"]["rank"].values(), result["peaks"]["worker"].values()

    def span(values: list[float]) -> str:
        return f"{min(values):,.0f} - {max(values):,.0f}" if values else "-"

    return (
        f"| {name} | {size_bytes / 1e9:,.2f} | {span([p['VmHWM'] / MB for p in ranks])} | "
        f"{span([p['RssAnon'] / MB for p in ranks])} | {span([p['VmHWM'] / MB for p in workers])} | "
        f"{span([p['RssAnon'] / MB for p in workers])} | {result['tokens_per_sec']:,.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help="where to write (and reuse) the token sets; default: a temporary dir")
    parser.add_argument("--large-gb", type=float, default=5.0, help="size of the large set in GB (uint16 tokens)")
    args = parser.parse_args()
    with nullcontext(args.dir) if args.dir else tempfile.TemporaryDirectory(prefix="shards_memory_") as root:
        root = Path(root)
        sets = {"small": (root / "small", 25 * 10**6), "large": (root / "large", int(args.large_gb * 1e9 / 2))}
        start = time.perf_counter()
        for name, (path, tokens) in sets.items():
            make_token_set(path, tokens, seed=len(name))
        print(f"token sets ready in {time.perf_counter() - start:.0f} s under {root}\n")
        results = {name: train(path, root / f"job-{name}") for name, (path, _) in sets.items()}
        loader = loader_tokens_per_sec(sets["large"][0])
        print(
            f"`python train.py model=gpt data=shards strategy=ddp trainer.devices=2 data.num_workers={WORKERS} "
            f"data.seq_length={SEQ} data.batch_size={BATCH} trainer.max_steps={STEPS}`, sampled every 0.1 s:\n"
        )
        print(
            "| token set | size (GB) | rank peak RSS (MiB) | of it anonymous (MiB) | worker peak RSS (MiB) | "
            "of it anonymous (MiB) | training tokens/s |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, (_, tokens) in sets.items():
            print(row(name, tokens * 2, results[name]))
        consumed = results["large"]["tokens_per_sec"] / 2  # per rank: each rank's loader feeds its half
        print(
            f"\nloader alone (large set, one rank's batches of {BATCH} x {SEQ}, {WORKERS} workers): {loader:,.0f} "
            f"tokens/s, {loader / consumed:,.0f}x what a training rank consumed ({consumed:,.0f} tokens/s)."
        )


if __name__ == "__main__":
    main()
