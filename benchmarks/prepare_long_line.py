"""``prepare`` on one long line: a single document of ``--megabytes`` MB (random words, seeded, no newline), prepared
with a trained BPE of ``--vocab-size`` tokens. Prints the wall time, prepare's peak resident memory (the child
process's ``ru_maxrss``), and the tokens of each split: the figures docs/data.md quotes (Preparing a corpus).

    python benchmarks/prepare_long_line.py                  # 50 MB, in a temporary dir removed afterwards

Not a test: it takes half a minute and a gigabyte.
"""

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_line(path: Path, megabytes: float, seed: int = 0) -> None:
    """Random words of 2 to 9 letters from a 5,000-word list, space-separated, in one line."""
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9))) for _ in range(5000)]
    with open(path, "w") as file:
        written = 0
        while written < megabytes * 1e6:
            chunk = " ".join(rng.choices(words, k=10_000)) + " "
            file.write(chunk)
            written += len(chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=50)
    parser.add_argument("--vocab-size", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus, out = Path(tmp) / "corpus", Path(tmp) / "out"
        corpus.mkdir()
        write_line(corpus / "one_line.txt", args.megabytes)
        command = [sys.executable, "-m", "project.cli.prepare", str(corpus), "--out", str(out)]
        # One document goes to one split whole: the line is all training text (a held-out split needs others).
        command += ["--vocab-size", str(args.vocab_size), "--val-fraction", "0"]
        start = time.perf_counter()
        subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**10  # KiB on Linux
        splits = json.loads((out / "meta.json").read_text())["splits"]
        size = (corpus / "one_line.txt").stat().st_size / 1e6
    print(f"one line of {size:.1f} MB: {seconds:.1f} s, prepare's peak RSS {peak:,.0f} MiB")
    print(", ".join(f"{name} {split['tokens']:,} tokens" for name, split in splits.items()))


if __name__ == "__main__":
    main()
